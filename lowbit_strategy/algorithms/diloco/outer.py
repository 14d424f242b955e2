"""The outer state of one fragment: the global weights, the outer momentum, the outer step.

DiLoCo (arXiv:2311.08105, Algorithm 1, lines 8-12): after H inner steps the outer gradient
is the workers' mean pseudo-gradient ``Δ = mean_i(θ_global − θ_i)``, and the outer
optimizer is SGD with Nesterov momentum, computed as ``torch.optim.SGD(lr, momentum,
nesterov=True)`` computes it (dampening 0): ``b ← μ·b + Δ``; ``d = Δ + μ·b`` (Nesterov) or
``b``; ``θ_global ← θ_global − lr·d``. Everything is float32, flat over the fragment's
parameters (their local tensors: FSDP2 shards under the sharded front end), on the
parameters' device or on the CPU (``offload: cpu``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lowbit_strategy.layout import local_view

__all__ = ["Fragment"]


class Fragment:
    """One fragment's parameters and outer state (module docstring)."""

    def __init__(self, index: int, params: Sequence[torch.Tensor], names: Sequence[str], device: torch.device):
        self.index = index
        self.params = list(params)
        self.names = list(names)
        self.device = device
        self.sizes = [local_view(p).numel() for p in self.params]
        self.n = sum(self.sizes)
        #: the global weights (None until the first step: see :meth:`snapshot`)
        self.global_: torch.Tensor | None = None
        self.momentum: torch.Tensor | None = None

    @torch.no_grad()
    def local(self) -> torch.Tensor:
        """The worker's weights, flat float32 on the state's device (a new tensor)."""
        if not self.params:
            return torch.zeros(0, dtype=torch.float32, device=self.device)
        return torch.cat([local_view(p).detach().reshape(-1).to(self.device, torch.float32) for p in self.params])

    def snapshot(self) -> None:
        """The global weights := the worker's weights (training starts; replicas are identical)."""
        self.global_ = self.local()
        self.momentum = torch.zeros_like(self.global_)

    def pseudo_gradient(self) -> torch.Tensor:
        """``θ_global − θ_local``: what this worker's inner steps moved, with DiLoCo's sign."""
        assert self.global_ is not None
        return self.global_ - self.local()

    @torch.no_grad()
    def outer_step(self, delta: torch.Tensor, lr: float, momentum: float, nesterov: bool) -> None:
        """Apply the mean pseudo-gradient ``delta`` to the global weights (module docstring)."""
        assert self.global_ is not None and self.momentum is not None
        delta = delta.to(self.device, torch.float32)
        self.momentum.mul_(momentum).add_(delta)
        step = delta.add(self.momentum, alpha=momentum) if nesterov else self.momentum
        self.global_.sub_(step, alpha=lr)

    @torch.no_grad()
    def write_back(self, alpha: float = 0.0) -> None:
        """The worker's weights := ``alpha·local + (1 − alpha)·global`` (``alpha = 0``: the global
        weights, exactly), cast to each parameter's dtype."""
        assert self.global_ is not None
        merged = self.global_ if alpha == 0.0 else self.local().mul_(alpha).add_(self.global_, alpha=1.0 - alpha)
        self.load_flat(merged)

    @torch.no_grad()
    def load_flat(self, flat: torch.Tensor) -> None:
        """Copy a flat float32 vector into the parameters' local tensors."""
        offset = 0
        for p, k in zip(self.params, self.sizes):
            t = local_view(p)
            t.copy_(flat[offset : offset + k].view(t.shape))
            offset += k
