"""The receive side of the 1-bit codes with scales (:mod:`.scaled_signs`): decode a code
back to ``s·sign`` and the server's mean of ``k`` codes.

"1-bit LAMB" (Li et al., arXiv:2104.06069), Algorithm 1, lines 10-11: the server averages
the ``m̂_t^(i)`` it receives, and every worker decodes the server's compressed chunks. Both
are gathers from small tables of the scaled signs of every byte value (no per-bit
unpacking, no separate scaling pass); on the CPU the mean runs slice by slice
(:mod:`.streaming`) and either may write into a buffer the caller keeps across calls.
"""

from __future__ import annotations

import torch

from lowbit_strategy.codecs.reduce import divide, rank_sum
from lowbit_strategy.codecs.signs import fused_kernels, signs_from_bits
from lowbit_strategy.codecs.streaming import SLICE, slices
from lowbit_strategy.validation import is_int

_PM1_TABLES: dict[torch.device, torch.Tensor] = {}


def _pm1_table(device: torch.device) -> torch.Tensor:
    """(256, 8) float32: the ±1 of the eight bits of every byte value (bit 1 -> +1)."""
    table = _PM1_TABLES.get(device)
    if table is None:
        byte_values = torch.arange(256, dtype=torch.uint8, device=device)
        table = _PM1_TABLES.setdefault(device, signs_from_bits(byte_values, 2048).view(256, 8))
    return table


def check_scale_block(block, what: str) -> None:
    """``ValueError`` naming ``block`` unless it is None or a positive multiple of 8: the scale
    block (elements per scale) of the 1-bit codecs, whole bytes of sign bits (the rotation
    block has its own rule, :func:`~.hadamard.check_rotation_block`)."""
    if block is not None and (not is_int(block, 8) or block % 8):
        raise ValueError(
            f"{what}: block must be None or a positive multiple of 8 (elements per scale; a byte of "
            f"sign bits must not straddle two blocks), got {block!r}"
        )


def _check_rows(
    bits: torch.Tensor, scales: torch.Tensor, what: str, block: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``bits`` as (k, c) uint8 rows and ``scales`` as (k,) float32, or as (k, nb) with
    ``nb = ceil(8c / block)`` block scales per row."""
    check_scale_block(block, what)
    if not isinstance(bits, torch.Tensor) or bits.dtype != torch.uint8 or bits.dim() not in (1, 2):
        raise TypeError(f"{what}: bits must be a 1-D or (k, c) uint8 tensor, got {getattr(bits, 'dtype', bits)!r}")
    rows = bits.view(1, -1) if bits.dim() == 1 else bits
    if not isinstance(scales, torch.Tensor) or not scales.dtype.is_floating_point:
        raise TypeError(f"{what}: scales must be a floating-point tensor")
    k, c = rows.shape
    if block is None:
        if scales.numel() != k:
            raise ValueError(f"{what}: {k} rows of bits need as many scales, got {scales.numel()}")
    else:
        nb = -(-8 * c // block)
        if scales.numel() != k * nb:
            raise ValueError(
                f"{what}: {k} rows of {c} bytes need {k} x ceil({8 * c}/block={block}) = {k * nb} block scales, "
                f"got {scales.numel()}"
            )
    if scales.device != bits.device:
        raise ValueError(f"{what}: scales are on {scales.device}, bits on {bits.device}")
    scales = scales.reshape(-1).float()
    return rows, scales if block is None else scales.view(k, -1)


_BYTE_BLOCKS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _byte_blocks(c: int, block: int, device: torch.device) -> torch.Tensor:
    """(c,) int64: the block of every byte of a row (``8j // block`` for byte ``j``); read
    only. The last few layouts are cached: a bucket's layout repeats every step."""
    key = (c, block, torch.device(device))
    got = _BYTE_BLOCKS.get(key)
    if got is None:
        got = torch.arange(0, 8 * c, 8, device=device).div_(block, rounding_mode="floor")
        if len(_BYTE_BLOCKS) >= 16:
            _BYTE_BLOCKS.pop(next(iter(_BYTE_BLOCKS)))
        _BYTE_BLOCKS[key] = got
    return got


def _block_tables(c: int, nb: int) -> bool:
    """Whether a ``(256, 8)`` table per block (2048 floats) is cheap next to the ``8c``
    floats of a row: at most an eighth of them (blocks of >= 16384 elements). Then one gather
    per byte from the tables; otherwise a gather of ±1 times each byte's scale. Same floats."""
    return 0 < 2048 * nb <= c


@torch.no_grad()
def scaled_sign_decode(
    bits: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    dtype: torch.dtype = torch.float32,
    block: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``C[v]`` back from its code: row ``r`` of ``bits`` decodes to ``scales[r] · (±1)``.

    ``bits``: ``(k, c)`` uint8, ``k`` chunks of ``c`` bytes laid out one after another (or
    1-D: one chunk), ``scales``: ``k`` values. Returns the first ``n`` of the ``8·k·c``
    decoded values, 1-D, as ``dtype``: the float32 value ``±scales[r]`` rounded to
    ``dtype``. One gather per byte from a ``(k·256, 8)`` table of the scaled signs of every
    byte value, so no per-bit unpacking and no separate scaling pass.

    ``block`` (a positive multiple of 8): per-block scales, ``(k, nb)`` or ``k·nb`` values
    with ``nb = ceil(8c/block)``; block ``b`` of row ``r`` (elements ``[b·block,
    (b+1)·block)`` of the row, the last one partial) decodes to ``scales[r, b] · (±1)``,
    rounded to ``dtype`` the same way. For blocks of 16384+ elements one gather per byte
    from a table per (row, block), as without blocks; for smaller ones (where such tables
    would outweigh the output) a gather of ±1 per byte times each byte's block scale.

    ``out``: a contiguous ``dtype`` tensor of ``n`` elements to decode into (the gather
    writes there: no full-size temporary and no copy), returned.

    On CUDA one pass of :mod:`.signs_triton`'s fused decode (the same values).
    """
    what = "scaled_sign_decode"
    rows, scales = _check_rows(bits, scales, what, block)
    k, c = rows.shape
    if not 0 <= n <= 8 * k * c:
        raise ValueError(f"{what}: cannot decode n={n} values from {k} x {c} bytes")
    if out is not None and (out.dtype != dtype or out.numel() != n or not out.is_contiguous()):
        raise ValueError(f"{what}: out must be a contiguous {dtype} tensor of n={n} elements")
    fused = fused_kernels(rows)
    if fused is not None and fused.decodes(dtype):
        return fused.decode(rows, scales, n, dtype, block, out)
    if block is not None:
        nb = scales.shape[1]
        byte_blocks = _byte_blocks(c, block, bits.device)
        if not _block_tables(c, nb):
            per_byte = scales[:, byte_blocks].to(dtype).view(k * c, 1)  # ±1 · round(s) = round(±s)
            pm1 = _pm1_table(bits.device).to(dtype)
            got = _gather(pm1, rows.reshape(-1).to(torch.int32), n, out)
            full = n // 8
            got[: 8 * full].view(full, 8).mul_(per_byte[:full])
            if n > 8 * full:
                got[8 * full :].mul_(per_byte[full])
            return got
        # one table per (row, block): index = (row·nb + block of the byte)·256 + byte
        table = (scales.view(k * nb, 1, 1) * _pm1_table(bits.device)).to(dtype).view(k * nb * 256, 8)
        index = torch.arange(0, k * nb, nb, dtype=torch.int32, device=bits.device).view(k, 1) + byte_blocks.int()
        index = index.mul_(256).add_(rows)
        return _gather(table, index.view(-1), n, out)
    table = (scales.view(k, 1, 1) * _pm1_table(bits.device)).to(dtype).view(k * 256, 8)
    index = torch.arange(0, 256 * k, 256, dtype=torch.int32, device=bits.device).view(k, 1) + rows
    return _gather(table, index.view(-1), n, out)


def _into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``result``, or copied into ``out`` when given."""
    if out is None:
        return result
    return out.copy_(result)


def _gather(table: torch.Tensor, index: torch.Tensor, n: int, out: torch.Tensor | None) -> torch.Tensor:
    """The first ``n`` values of ``table.index_select(0, index)`` (rows of 8), 1-D: into
    ``out`` when given (whole bytes gathered in place, the last partial byte's values copied)."""
    if out is None:
        return table.index_select(0, index).view(-1)[:n]
    full = n // 8
    if full:
        torch.index_select(table, 0, index[:full], out=out[: 8 * full].view(full, 8))
    if n > 8 * full:
        out[8 * full :] = table[index[full]][: n - 8 * full]
    return out


@torch.no_grad()
def scaled_sign_mean(
    bits: torch.Tensor, scales: torch.Tensor, block: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The mean of ``k`` decoded codes: ``Σ_r (scales[r] / k) · (±1)_r`` for all ``8c`` bits.

    1-bit LAMB (arXiv:2104.06069) Algorithm 1, line 10: the server's average of the
    ``m̂_t^(i)`` it receives. ``bits``: ``(k, c)`` uint8, one row per sender; ``scales``:
    ``k`` values. Returns ``8c`` float32 values (padding bits included: the caller slices).

    The order is fixed, so every run gives the same floats: weights ``w_r = scales[r] / k``
    in float32, each ``w_r·±1`` exact, summed over rows by
    :func:`~lowbit_strategy.codecs.reduce.rank_sum` (a fixed pairwise tree; row order for
    ``k ≤ 3``), one rounding per addition. All rows at once, through per-row ``(256, 8)``
    tables of ``±w_r``: a handful of kernels whatever ``k``, and ``k`` chunks of floats of
    extra memory (the size of the bucket the chunks came from).

    ``block`` (a positive multiple of 8): per-block scales, ``(k, nb)`` or ``k·nb`` values
    with ``nb = ceil(8c/block)``: row ``r``'s block ``b`` weighs ``w_rb = scales[r, b] / k``.
    Same order and roundings (``w_rb·±1`` is exact), through a table of ``±w_rb`` per
    block (blocks of 16384+ elements) or a ±1 gather per byte times each byte's weight.

    ``out``: a contiguous float32 tensor of ``8c`` elements to write the mean into (a
    buffer kept across calls has no page faults to take), returned.

    On CUDA one pass of :mod:`.signs_triton`'s fused mean (the same order, the same floats)
    for up to ``signs_triton.MAX_ROWS`` rows.
    """
    rows, scales = _check_rows(bits, scales, "scaled_sign_mean", block)
    k, c = rows.shape
    if out is not None and (out.dtype != torch.float32 or out.numel() != 8 * c or not out.is_contiguous()):
        raise ValueError(f"scaled_sign_mean: out must be a contiguous float32 tensor of 8c = {8 * c} elements")
    fused = fused_kernels(rows)
    if fused is not None and k <= fused.MAX_ROWS:
        return fused.mean(rows, divide(scales, k), block, out)
    device = bits.device
    index = rows.to(torch.int32)
    if block is not None and not _block_tables(c, scales.shape[1]):
        weights = divide(scales, k)[:, _byte_blocks(c, block, device)].unsqueeze(-1)  # (k, c, 1)
        terms = _pm1_table(device).index_select(0, index.view(-1)).view(k, c, 8).mul_(weights)  # exact products
        return _into(rank_sum(terms).reshape(-1), out)
    if block is not None:  # a (256, 8) table of ±w per (row, block), as below with one per row
        nb = scales.shape[1]
        tables = (divide(scales, k).view(k, nb, 1, 1) * _pm1_table(device)).view(k * nb * 256, 8)
        offsets = _byte_blocks(c, block, device).to(torch.int32).mul_(256)
        first = torch.arange(0, k * nb * 256, nb * 256, dtype=torch.int32, device=device).view(k, 1)
    else:
        tables = (divide(scales, k).view(k, 1, 1) * _pm1_table(device)).view(k * 256, 8)  # (k·256, 8): ±w_r
        offsets = torch.zeros((), dtype=torch.int32, device=device)
        first = torch.arange(0, k * 256, 256, dtype=torch.int32, device=device).view(k, 1)
    index = first + offsets + index  # (k, c): each byte's row of ±w
    if device.type != "cpu" or 8 * k * c <= SLICE:
        return _into(rank_sum(tables.index_select(0, index.view(-1)).view(k, c, 8)).reshape(-1), out)
    # on the CPU, slices of the bytes (:mod:`.streaming`): the k rows' terms of a slice stay in
    # the cache; rank_sum adds rows element by element, so slicing the columns keeps its bits
    if out is None:
        out = torch.empty(8 * c, dtype=torch.float32, device=device)
    step = max(1, SLICE // (8 * k))
    buf = torch.empty(k * step * 8, dtype=torch.float32, device=device)
    for lo, hi in slices(c, step):
        terms = buf[: k * (hi - lo) * 8].view(k * (hi - lo), 8)
        torch.index_select(tables, 0, index[:, lo:hi].reshape(-1), out=terms)
        out[8 * lo : 8 * hi] = rank_sum(terms.view(k, hi - lo, 8)).reshape(-1)
    return out
