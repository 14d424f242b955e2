"""Symmetric blockwise integer quantization of rows: the codec of the quantized FSDP
reduce-scatter (:mod:`lowbit_strategy.collectives.fsdp_reduce_scatter`).

Each row of a ``(R, n)`` float tensor is cut into blocks of :data:`BLOCK` elements (the last
one zero-padded); a block ``x`` of ``b``-bit codes has one float32 scale
``s = max|x| / Q`` with ``Q = 2**(b-1) - 1`` (127, 7, 1) and codes
``q = round(x / s)`` in ``[-Q, Q]``, stored offset by ``Q`` as unsigned ``b``-bit lanes
(:mod:`.bits`, little-endian inside each byte), so a block costs ``BLOCK·b/8 + 4`` bytes.
This is the symmetric INT4/INT8 blockwise form of ZeRO++'s qgZ ("ZeRO++: Extremely Efficient
Collective Communication for Giant Model Training", arXiv:2306.10209, Sec. 4.3), one scale
per block.

Rounding: to nearest (ties to even, ``torch.round``) at 8 and 4 bits; **stochastic** at 2
bits, whose three levels {-s, 0, s} would otherwise zero every element below ``s/2`` and
bias the sum: ``q = floor(x/s + u)`` with ``u`` uniform in [0, 1), so ``E[q·s] = x``. The
uniform ``u`` is a counter-free hash (:func:`dither`) of the element's float32 bits, its
index and a caller's salt: deterministic on every device, with no generator state to
carry through a checkpoint, and computed on the device (no host read).

A block holding a NaN or an infinity gets a NaN scale, so every element of it decodes to
NaN: a non-finite gradient stays visible downstream (the step's finite check) instead of
being quantized into a finite wrong value.
"""

from __future__ import annotations

import torch

from lowbit_strategy.codecs import bits as lanes

__all__ = ["BLOCK", "LEVELS", "decode", "dither", "encode", "row_bytes"]

#: elements per scale (the issue's "one scale per block of <= 256")
BLOCK = 256
#: bits -> Q, the largest code magnitude
LEVELS = {8: 127, 4: 7, 2: 1}
_MASK32 = 0xFFFFFFFF


def blocks(n: int, block: int = BLOCK) -> int:
    """Blocks of one ``n``-element row."""
    return -(-n // block)


def row_bytes(n: int, bits: int, block: int = BLOCK) -> tuple[int, int]:
    """``(code bytes, scale bytes)`` of one encoded ``n``-element row."""
    nb = blocks(n, block)
    return nb * block * bits // 8, nb * 4


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche (murmur3's finalizer with 31-bit multipliers: every product of a
    32-bit value and a multiplier stays below 2**63, so int64 never overflows)."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _MASK32
    h = h ^ (h >> 15)
    h = (h * 0x5BD1E995) & _MASK32
    return h ^ (h >> 16)


def dither(x: torch.Tensor, salt: int) -> torch.Tensor:
    """Uniform float32 in [0, 1) (multiples of 2**-24), one per element of float32 ``x``: a
    hash of the element's bits, its flat index and ``salt`` (callers pass their rank and
    the tensor's identity, so equal values elsewhere draw other numbers)."""
    value = x.contiguous().view(torch.int32).to(torch.int64) & _MASK32
    index = torch.arange(x.numel(), device=x.device, dtype=torch.int64).view(x.shape)
    h = (value * 0x1B873593 + index * 0x27D4EB2F + (salt & _MASK32)) & _MASK32
    h = _mix(_mix(h) ^ (index & _MASK32))
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def _blocked(rows: torch.Tensor, block: int) -> torch.Tensor:
    """``(R, nb, block)`` float32 view of ``rows`` zero-padded to whole blocks."""
    r, n = rows.shape
    nb = blocks(n, block)
    x = rows.to(torch.float32)
    if nb * block != n:
        x = torch.nn.functional.pad(x, (0, nb * block - n))
    return x.reshape(r, nb, block)


def encode(rows: torch.Tensor, bits: int, *, salt: int = 0, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scales)`` of 2-D ``rows`` (any float dtype): codes ``(R, code bytes)`` uint8,
    scales ``(R, blocks)`` float32 (module docstring). ``salt`` seeds the 2-bit dither."""
    q_max = LEVELS[bits]
    x = _blocked(rows, block)
    amax = x.abs().amax(dim=2, keepdim=True)
    finite = torch.isfinite(x).all(dim=2, keepdim=True)
    scale = torch.where(finite, amax / q_max, torch.full_like(amax, float("nan")))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero (or NaN) block: codes 0
    y = torch.nan_to_num(x / safe, nan=0.0, posinf=0.0, neginf=0.0)
    if bits == 2:
        q = torch.floor(y + dither(x, salt))
    else:
        q = torch.round(y)
    codes = (q.clamp_(-q_max, q_max) + q_max).to(torch.uint8)
    r = rows.shape[0]
    packed = lanes.pack(codes.reshape(-1), bits, validate=False).view(r, -1)
    return packed, scale.reshape(r, -1)


def decode(codes: torch.Tensor, scales: torch.Tensor, bits: int, n: int, *, block: int = BLOCK) -> torch.Tensor:
    """The ``(R, n)`` float32 rows of :func:`encode`'s ``(codes, scales)``."""
    q_max = LEVELS[bits]
    r, nb = scales.shape
    q = lanes.unpack(codes.reshape(-1), bits, r * nb * block).view(r, nb, block)
    x = (q.to(torch.float32) - q_max) * scales.unsqueeze(2)
    return x.reshape(r, nb * block)[:, :n]
