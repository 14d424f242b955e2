"""PowerSGD (Vogels et al. 2019) on a list of gradient tensors, for the benchmarks.

The same math and communication as ``torch.distributed.algorithms.ddp_comm_hooks.
powerSGD_hook`` after its warm-up phase, reimplemented with torch ops because that hook
needs a DDP ``GradBucket`` (not constructible from Python). Per synchronization:

1. tensors PowerSGD would not compress (vectors, and matrices where
   ``(n + m)·r·min_compression_rate >= n·m``) are concatenated and allreduced in fp32;
2. with error feedback, ``M += error``; ``P_i = M_i Q_i`` for every matrix, all ``P_i``
   in one allreduce; each ``P_i`` is orthogonalized;
3. ``Q_i = M_iᵀ P_i``, all ``Q_i`` in one allreduce;
4. ``M_i ≈ P_i Q_iᵀ / world_size``; the error becomes ``M_i - approximation``.

``Q`` is warm-started from the previous call and initialized from the same seed on every
rank (as the hook does). Three allreduces go through
:func:`lowbit_strategy.collectives.full_allreduce`, so their bytes are recorded.
"""
from __future__ import annotations

import math

import torch

from lowbit_strategy.collectives import full_allreduce

try:  # the hook's own in-place orthogonalization of a (batch, n, r) tensor
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize as _hook_orthogonalize
except ImportError:  # pragma: no cover - a torch without it
    _hook_orthogonalize = None


def _orthogonalize(p: torch.Tensor) -> None:
    """Orthonormalize the columns of ``p`` in place (Gram–Schmidt for r <= 2, else QR)."""
    if _hook_orthogonalize is not None:
        _hook_orthogonalize(p.unsqueeze(0))
    else:
        p.copy_(torch.linalg.qr(p).Q)


def transformer_shapes(numel: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a small GPT-like model with exactly ``numel`` parameters.

    Hidden size ``d`` is the power of two nearest ``sqrt(numel / 96)``; as many blocks
    as fit in ~80 % of the budget (up to a dozen; each: qkv ``3d×d``, out ``d×d``, MLP
    ``4d×d`` and ``d×4d``, their biases and two LayerNorms); the rest is a token
    embedding ``V×d`` plus one vector for the last few parameters.
    """
    if numel < 1024:
        raise ValueError(f"numel must be >= 1024 to make a model, got {numel}")
    d = max(16, 2 ** round(math.log2(math.sqrt(numel / 96))))
    block = [(3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,)]
    block_numel = sum(math.prod(s) for s in block)
    blocks = max(1, int(0.8 * numel) // block_numel) if block_numel < numel else 0
    shapes = block * blocks
    rest = numel - blocks * block_numel
    if rest >= d:
        shapes.insert(0, (rest // d, d))
    if rest % d:
        shapes.append((rest % d,))
    assert sum(math.prod(s) for s in shapes) == numel
    return shapes


class PowerSGD:
    """Rank-``rank`` PowerSGD state for gradients of ``shapes`` (error feedback, warm start)."""

    def __init__(self, shapes: list[tuple[int, ...]], rank: int, *, seed: int = 0,
                 min_compression_rate: float = 2.0) -> None:
        self.shapes, self.rank = shapes, rank
        self.compressed = [
            len(s) == 2 and (s[0] + s[1]) * rank * min_compression_rate < s[0] * s[1] for s in shapes
        ]
        gen = torch.Generator().manual_seed(seed)
        self.qs = {i: torch.randn(s[1], rank, generator=gen) for i, s in enumerate(shapes) if self.compressed[i]}
        self.errors = {i: torch.zeros(s) for i, s in enumerate(shapes) if self.compressed[i]}

    def payload_numels(self) -> list[int]:
        """Elements of the three allreduced buffers: uncompressed tensors, all P, all Q."""
        plain = sum(math.prod(s) for s, c in zip(self.shapes, self.compressed) if not c)
        ps = sum(s[0] * self.rank for s, c in zip(self.shapes, self.compressed) if c)
        qs = sum(s[1] * self.rank for s, c in zip(self.shapes, self.compressed) if c)
        return [n for n in (plain, ps, qs) if n]

    def synchronize(self, grads: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
        """The averaged (approximate) gradients; updates the error and warm-start state."""
        out: list[torch.Tensor | None] = [None] * len(grads)
        plain = [i for i, c in enumerate(self.compressed) if not c]
        if plain:
            flat = full_allreduce(torch.cat([grads[i].reshape(-1) for i in plain])) / world_size
            for i, chunk in zip(plain, flat.split([grads[i].numel() for i in plain])):
                out[i] = chunk.view(grads[i].shape)
        mats = [i for i, c in enumerate(self.compressed) if c]
        if not mats:
            return out
        ms = {i: grads[i] + self.errors[i] for i in mats}
        ps = self._allreduce_cat([ms[i] @ self.qs[i] for i in mats])
        for p in ps:
            _orthogonalize(p)
        qs = self._allreduce_cat([ms[i].t() @ p for i, p in zip(mats, ps)])
        for i, p, q in zip(mats, ps, qs):
            approx = (p @ q.t()) / world_size
            self.errors[i] = ms[i] - approx
            self.qs[i] = q
            out[i] = approx
        return out

    @staticmethod
    def _allreduce_cat(factors: list[torch.Tensor]) -> list[torch.Tensor]:
        flat = full_allreduce(torch.cat([f.reshape(-1) for f in factors]))
        return [c.view(f.shape).clone() for c, f in zip(flat.split([f.numel() for f in factors]), factors)]
