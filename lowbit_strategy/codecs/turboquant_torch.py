"""The torch backend of :class:`~lowbit_strategy.codecs.turboquant.TurboQuantCodec`: encode
and decode of flat float32 vectors with torch operations, on any device.

The reference for the Triton kernels (:mod:`.turboquant_triton`), which reproduce it bit for
bit; the codec also runs it on whatever the kernels leave over (the tail past the last fused
block). The rules (scale groups, the RMS order, ties, clamping, packing) are the codec's,
in :mod:`.turboquant`'s module docstring. Pure: no process group, no host synchronization.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lowbit_strategy.codecs.bits import pack
from lowbit_strategy.codecs.hadamard import blocked_fwht, blocked_fwht_rows
from lowbit_strategy.codecs.streaming import SLICE, sliced, slices


def apply_scales(
    v: torch.Tensor, scales: torch.Tensor, block: int, op: Callable[[torch.Tensor, torch.Tensor], object]
) -> torch.Tensor:
    """``op(v_group, scale_group)`` in place on every scale group of flat ``v`` (groups of
    ``block`` elements, the last one partial; one scale: every group)."""
    n, b = v.numel(), block
    if scales.numel() == 1:
        op(v, scales.view(()))
        return v
    q = n // b
    if q:
        op(v[: q * b].view(q, b), scales[:q].view(q, 1))
    if n > q * b:
        op(v[q * b :], scales[q])
    return v


def group_rms(y: torch.Tensor, block: int) -> torch.Tensor:
    """Per-group RMS of flat float32 ``y`` ("RMS order" in :mod:`.turboquant`): full groups
    by the fold-in-halves tree that the Triton kernel reproduces exactly.

    In torch: one multiply writes the squares, then ``log2(block)`` in-place adds, each on
    two contiguous halves of what is left (``s[:, :h] += s[:, h:2h]``): about 2.5 passes
    over the groups' memory, against ~10 strided passes and as many fresh tensors for the
    adjacent-pair tree it replaces (3.5 -> 2.6 ms on 4 Mi elements, one thread; a single
    ``vector_norm`` reads once, 0.65 ms, but in an order only torch on that CPU knows)."""
    n, b = y.numel(), block
    q = n // b
    parts = []
    if q:
        rows = y[: q * b].view(q, b)
        sq = rows * rows
        width = b
        while width > 1:
            half = width // 2
            sq[:, :half].add_(sq[:, half:width])
            width = half
        # the square root in float64, rounded once to float32: the correctly rounded
        # float32 square root (torch's float32 sqrt on CPU is not always), which is what
        # the kernel's IEEE sqrt gives
        parts.append(sq[:, 0].mul(1.0 / b).double().sqrt_().float())
    if n > q * b:
        parts.append((torch.linalg.vector_norm(y[q * b :]) / math.sqrt(n - q * b)).view(1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def level_index(z: torch.Tensor, midpoints: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 index of the nearest level: the number of midpoints strictly below ``z``
    (``torch.bucketize(z, midpoints, right=False)``). Up to 15 midpoints (4 bits) as one
    comparison pass per midpoint, which on CPU is a few times faster than bucketize's
    binary search; wider codebooks use bucketize. Same codes either way."""
    if bits <= 4:
        acc = torch.empty(z.shape, dtype=torch.uint8, device=z.device)
        if sliced(z) and z.dim() == 1:  # slice by slice (:mod:`.streaming`): the same comparisons
            above = torch.empty(SLICE, dtype=torch.uint8, device=z.device)
            for start, stop in slices(z.numel()):
                _count_above(z[start:stop], midpoints, acc[start:stop], above[: stop - start])
            return acc
        return _count_above(z, midpoints, acc, torch.empty_like(acc))
    return torch.bucketize(z, midpoints, out_int32=True).to(torch.uint8)


def _count_above(z: torch.Tensor, midpoints: torch.Tensor, acc: torch.Tensor, above: torch.Tensor) -> torch.Tensor:
    """``acc`` (uint8) = how many ``midpoints`` are strictly below ``z``; ``above``: a uint8
    buffer of ``z``'s shape. Comparisons write 0/1 int8 into byte views (see
    :func:`.signs.compare_bytes`), and the sum adds uint8 to uint8 (a bool operand takes a
    mixed-dtype path)."""
    torch.gt(z, midpoints[0], out=acc.view(torch.int8))
    for k in range(1, midpoints.numel()):
        torch.gt(z, midpoints[k], out=above.view(torch.int8))
        acc.add_(above)
    return acc
    return torch.bucketize(z, midpoints, out_int32=True).to(torch.uint8)


def encode(
    v: torch.Tensor,
    signs: torch.Tensor | None,
    scale: torch.Tensor | None,
    *,
    block: int,
    midpoints: torch.Tensor,
    bits: int,
    lane_bits: int,
    owned: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (packed) and scales of flat float32 ``v`` (a whole tensor, or the part after the
    fused blocks: it starts on a group boundary and a code byte). ``signs``: float ±1 for
    ``v`` (``None``: no rotation); ``scale``: ``None`` (RMS) or checked scales for ``v``'s
    groups (1 value: shared). ``v`` is not modified unless ``owned``."""
    if signs is not None:
        y = blocked_fwht(v * signs, block)
    else:
        y = v if owned else v.clone()
    scales = group_rms(y, block) if scale is None else scale
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    apply_scales(y, safe, block, torch.Tensor.div_)
    return pack(level_index(y, midpoints, bits), lane_bits, validate=False), scales


def decode(
    idx: torch.Tensor, scales: torch.Tensor, signs: torch.Tensor | None, *, block: int, levels: torch.Tensor
) -> torch.Tensor:
    """Flat float32 values of unpacked codes ``idx`` (starting on a group boundary)."""
    y = levels.index_select(0, idx.to(torch.int32))
    apply_scales(y, scales, block, torch.Tensor.mul_)
    if signs is not None:
        y = blocked_fwht(y, block).mul_(signs)
    return y


def decode_rows(
    idx: torch.Tensor, scales: torch.Tensor, signs: torch.Tensor | None, *, block: int, levels: torch.Tensor
) -> torch.Tensor:
    """:func:`decode` of ``R`` payloads of ``m`` elements at once: ``idx`` ``(R, m)``
    unpacked codes, ``scales`` ``(R, g)`` (``g`` groups per row, or 1: shared by the row),
    ``signs`` the ``m`` signs every row uses. Returns ``(R, m)`` float32, each row bit for
    bit what :func:`decode` gives for it alone, in a few kernels whatever ``R``."""
    rows, m = idx.shape
    y = levels.index_select(0, idx.reshape(-1).to(torch.int32)).view(rows, m)
    if scales.shape[1] == 1:
        y.mul_(scales)
    else:
        q = m // block
        if q:
            y[:, : q * block].view(rows, q, block).mul_(scales[:, :q].unsqueeze(-1))
        if m > q * block:
            y[:, q * block :].mul_(scales[:, q : q + 1])
    if signs is not None:
        y = blocked_fwht_rows(y, block).mul_(signs)
    return y
