"""Randomized, blocked Walsh–Hadamard rotation: the pre-rotation of the TurboQuant codec.

"TurboQuant-Adam" rotates a tensor ``x`` before quantizing it, ``y = H·D·x``, with ``D`` a
diagonal of random ±1 signs and ``H`` a normalized Walsh–Hadamard matrix: every output
coordinate mixes many inputs with random signs, so whatever the input's distribution
(heavy tails, outliers), the rotated coordinates are close to Gaussian and a Gaussian
codebook (:mod:`.lloyd_max`) fits them.

Layout (the paper leaves the blocking open; these are this library's choices):

* **Blocks.** ``x`` is flattened and cut into blocks of ``block`` consecutive elements
  (a power of two, default :data:`DEFAULT_BLOCK` = 1024: enough mixing to Gaussianize, ten
  butterfly passes). Each block is rotated on its own by the ``block × block`` Sylvester
  Hadamard matrix ``H_b`` (``H_1 = [1]``, ``H_2k = [[H_k, H_k], [H_k, -H_k]]``) scaled by
  ``1/sqrt(block)``, which makes it orthonormal and symmetric.
* **Tail.** A length that is not a multiple of ``block`` leaves a tail of ``r < block``
  elements. It is cut into the largest power-of-two pieces that fit, in decreasing size
  (``r = 700`` → 512, 128, 32, 16, 8, 4), each rotated by its own normalized Hadamard
  matrix (a piece of 1 only gets its sign). No padding: the output has exactly ``n``
  elements, and the transform stays exactly orthonormal. The small pieces mix little
  (their coordinates stay closer to the input's distribution); they are at most
  ``block - 1`` elements of the whole.
* **Signs.** ``D`` holds one ±1 per element of the flattened ``x`` (``n`` signs), drawn
  from a CPU :class:`torch.Generator` seeded with ``seed``: ``torch.randint(0, 2, (n,))``,
  bit 1 → +1, 0 → −1. The same ``(n, seed)`` gives the same signs on every rank and
  device; :func:`hadamard_signs` returns them so a caller can keep them.
* **Inverse.** ``H`` normalized is its own inverse, so ``x = D·H·y``:
  :func:`hadamard_unrotate` is the same butterfly with the signs applied after it.
  ``hadamard_unrotate(hadamard_rotate(x)) == x`` up to float32 rounding (each of the
  ``log2(block)`` passes rounds once).

Arithmetic is float32 whatever the input dtype (16-bit inputs convert exactly, float64 is
rounded first); outputs are flat float32 tensors of ``n`` elements on the input's device.
The butterfly is ``O(n log block)``: each pass views the data as ``(…, 2, h)`` and writes
``a + b`` and ``a − b`` into a second buffer (two buffers in all, no dense matrix).
"""

from __future__ import annotations

import math

import torch

from lowbit_strategy.codecs.streaming import SLICE, sliced
from lowbit_strategy.validation import is_int

#: default block size of the rotation (elements)
DEFAULT_BLOCK = 1024
#: largest accepted block size
MAX_BLOCK = 2**20


def check_rotation_block(block) -> int:
    """``block`` as an int; ``ValueError`` naming ``block`` unless a power of two in [2, 2**20]:
    the rotation block, which the Walsh–Hadamard transform needs a power of two for (the
    scale block of the 1-bit codecs has its own rule, :func:`~.scaled_signs_decode.check_scale_block`)."""
    if not is_int(block, 2, MAX_BLOCK) or block & (block - 1):
        raise ValueError(f"block must be a power of two in [2, {MAX_BLOCK}], got {block!r}")
    return block


#: rotation seeds: what a torch.Generator takes, and what the config's ``seed`` allows
MAX_SEED = 2**63 - 1


def check_seed(seed) -> int:
    if not is_int(seed):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**63 - 1], got {seed}")
    return seed


def hadamard_signs(n: int, seed: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The ``n`` float32 ±1 signs ``D`` for ``seed``, on ``device`` (drawn on the CPU)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(check_seed(seed))
    bits = torch.randint(0, 2, (n,), generator=g, dtype=torch.int8)
    signs = bits.to(torch.float32).mul_(2.0).sub_(1.0)
    return signs if device is None else signs.to(device)


def tail_pieces(r: int) -> list[int]:
    """The power-of-two piece sizes a tail of ``r`` elements is cut into, largest first."""
    return [1 << k for k in range(r.bit_length() - 1, -1, -1) if r >> k & 1]


def _fwht_rows(x: torch.Tensor) -> torch.Tensor:
    """Normalized Hadamard transform of every row of a contiguous 2-D float32 ``x`` (rows of
    a power-of-two length); returns a new tensor, ``x`` is left unchanged.

    On the CPU, many rows go through in groups of about :data:`.streaming.SLICE` elements:
    each row's butterflies are the same operations whichever rows share a call, and the
    ping-pong buffers of a group stay in the cache (~1.8x faster on 4 Mi elements)."""
    rows, size = x.shape
    if sliced(x) and rows > 1:
        out = torch.empty_like(x)
        step = max(1, SLICE // size)
        for start in range(0, rows, step):
            out[start : start + step] = _fwht_rows_whole(x[start : start + step])
        return out
    return _fwht_rows_whole(x)


def _fwht_rows_whole(x: torch.Tensor) -> torch.Tensor:
    """:func:`_fwht_rows` on all rows at once."""
    rows, size = x.shape
    if size == 1:
        return x.clone()
    src, dst = x, torch.empty_like(x)
    spare = None
    h = 1
    while h < size:
        s = src.view(rows, size // (2 * h), 2, h)
        d = dst.view(rows, size // (2 * h), 2, h)
        a, b = s[:, :, 0], s[:, :, 1]
        torch.add(a, b, out=d[:, :, 0])
        torch.sub(a, b, out=d[:, :, 1])
        if spare is None:  # first pass: never write into the caller's x
            spare = torch.empty_like(x)
            src, dst = dst, spare
        else:
            src, dst = dst, src
        h *= 2
    return src.mul_(1.0 / math.sqrt(size))


def blocked_fwht(v: torch.Tensor, block: int) -> torch.Tensor:
    """The blocked transform (blocks, then the tail's pieces) of a flat float32 ``v``."""
    n = v.numel()
    q = n // block * block
    parts = []
    if q:
        parts.append(_fwht_rows(v[:q].view(-1, block)).view(-1))
    start = q
    for size in tail_pieces(n - q):
        parts.append(_fwht_rows(v[start : start + size].view(1, size)).view(-1))
        start += size
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts) if parts else v.clone()


def blocked_fwht_rows(y: torch.Tensor, block: int) -> torch.Tensor:
    """:func:`blocked_fwht` of every row of a contiguous 2-D float32 ``y`` (``R`` rows of
    ``m`` elements) at once: each row exactly as :func:`blocked_fwht` transforms it alone
    (the same butterflies on the same blocks), in a few kernels whatever ``R``."""
    rows, n = y.shape
    q = n // block * block
    parts = []
    if q:
        parts.append(_fwht_rows(y[:, :q].reshape(-1, block)).view(rows, q))
    start = q
    for size in tail_pieces(n - q):
        parts.append(_fwht_rows(y[:, start : start + size].contiguous()))
        start += size
    if len(parts) == 1:
        return parts[0]
    return torch.cat(parts, dim=1) if parts else y.clone()


def _flat_float32(x: torch.Tensor, name: str, what: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"{what}: {name} must be a floating-point tensor, got dtype {x.dtype}")
    return x.reshape(-1).to(torch.float32).contiguous()


def _signs_for(n: int, seed: int, device, signs: torch.Tensor | None) -> torch.Tensor:
    if signs is None:
        return hadamard_signs(n, seed, device)
    if signs.shape != (n,):
        raise ValueError(f"signs must hold one value per element ({n}), got shape {tuple(signs.shape)}")
    return signs


@torch.no_grad()
def hadamard_rotate(
    x: torch.Tensor, seed: int, block: int = DEFAULT_BLOCK, *, signs: torch.Tensor | None = None
) -> torch.Tensor:
    """``y = H·D·x`` over the flattened ``x``: a flat float32 tensor of ``x.numel()`` values.

    ``signs``: the ``D`` of :func:`hadamard_signs` for ``(x.numel(), seed)`` on ``x``'s
    device, to skip drawing them again (``seed`` is then unused).
    """
    block = check_rotation_block(block)
    v = _flat_float32(x, "x", "hadamard_rotate")
    d = _signs_for(v.numel(), seed, v.device, signs)
    return blocked_fwht(v * d, block)


@torch.no_grad()
def hadamard_unrotate(
    y: torch.Tensor, seed: int, block: int = DEFAULT_BLOCK, *, signs: torch.Tensor | None = None
) -> torch.Tensor:
    """``x = D·H·y``, the inverse of :func:`hadamard_rotate` with the same ``seed``/``block``:
    a flat float32 tensor (reshape it to the original shape)."""
    block = check_rotation_block(block)
    v = _flat_float32(y, "y", "hadamard_unrotate")
    d = _signs_for(v.numel(), seed, v.device, signs)
    return blocked_fwht(v, block).mul_(d)
