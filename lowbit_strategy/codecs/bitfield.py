"""Unsigned codes of any width from 1 to 24 bits, packed end to end into bytes.

:mod:`.bits` packs lanes that tile a machine word (1, 2, 4, 8, 16, 32 bits), so that packed
words can be summed; DeMo's top-k indices need ``⌈log2(chunk size)⌉`` bits (12 for a 64 x 64
chunk), which no lane fits without waste, and are only ever gathered, never summed. Here code
``i`` occupies bits ``i·b .. i·b + b - 1`` of the little-endian bit stream (bit ``j`` of the
stream is bit ``j % 8`` of byte ``j // 8``), the last byte zero-padded: ``⌈n·b / 8⌉`` bytes.
"""

from __future__ import annotations

import torch

from lowbit_strategy.codecs.bits import pack, unpack

__all__ = ["bitfield_bytes", "pack_bitfield", "unpack_bitfield"]

MAX_BITS = 24


def bitfield_bytes(n: int, bits: int) -> int:
    """Bytes of ``n`` codes of ``bits`` bits each."""
    return -(-n * bits // 8)


def _check(bits: int) -> None:
    if not 0 <= bits <= MAX_BITS:
        raise ValueError(f"bitfield: bits={bits} is not in [0, {MAX_BITS}]")


def pack_bitfield(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """1-D integer ``codes`` in ``[0, 2**bits)`` -> uint8 (``bitfield_bytes(n, bits)``).
    Codes out of range give unspecified bytes (hot path: in range by construction)."""
    _check(bits)
    if bits == 0 or codes.numel() == 0:
        return torch.zeros(bitfield_bytes(codes.numel(), bits), dtype=torch.uint8, device=codes.device)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = (codes.to(torch.int32).unsqueeze(1) >> shifts).bitwise_and_(1).to(torch.uint8).reshape(-1)
    return pack(stream, 1, validate=False)


def unpack_bitfield(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bitfield`: the first ``n`` codes of ``data`` (uint8), as int64."""
    _check(bits)
    if bits == 0 or n == 0:
        return torch.zeros(n, dtype=torch.int64, device=data.device)
    stream = unpack(data, 1, n * bits).view(n, bits).to(torch.int64)
    weights = torch.ones(bits, dtype=torch.int64, device=data.device) << torch.arange(bits, device=data.device)
    return (stream * weights).sum(1)
