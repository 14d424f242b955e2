"""BitDP channel-wise 1-bit and 2-bit codes (BitDP Sec. 3.1.2, Eq. 4-9, App. B).

A gradient matrix g (m x n; channels are the rows = output features) is approximated as
g ≈ s ⊙ q with one scale per row, minimizing ||g - s ⊙ q||² (Eq. 3):

* 1-bit (Eq. 5-6): q = +1 where g >= 0, -1 where g < 0 (so an exact zero is +1);
  s_i = mean_j |g_ij|, the MSE-optimal scale for binary codes.
* 2-bit ternary (Eq. 7): with threshold α_i = ¾ · mean_j |g_ij| (Eq. 9, App. B: the
  optimum h/4 of a triangular distribution, written through its mean),
  q = +1 where g >= α, -1 where g < -α, 0 otherwise; s_i = mean of |g_ij| over the kept
  entries (q != 0), the MSE-optimal scale (Eq. 4). A row with no kept entry gets s = 0.

Codes are returned as unsigned lane values ready for :func:`lowbit_strategy.codecs.bits.pack`:
1-bit: 1 for +1, 0 for -1;  2-bit: 0 for 0, 1 for +1, 2 for -1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lowbit_strategy.codecs import compiled
from lowbit_strategy.codecs.lp import all_finite
from lowbit_strategy.codecs.signs import compare_bytes
from lowbit_strategy.codecs.streaming import SLICE, row_slices, sliced

THRESHOLD_FACTOR = 0.75

#: 2-bit code values of the ternary levels (0, +1, -1); 3 is unused.
TERNARY_ZERO, TERNARY_PLUS, TERNARY_MINUS = 0, 1, 2


def _as_rows(g: torch.Tensor, validate: bool = True) -> torch.Tensor:
    if not g.dtype.is_floating_point:
        raise TypeError(f"channel codes need a floating-point gradient, got dtype {g.dtype}")
    if g.dim() < 1 or g.numel() == 0:
        raise ValueError(f"channel codes need a non-empty tensor, got shape {tuple(g.shape)}")
    if validate and not all_finite(g):
        raise ValueError("channel codes: gradient contains NaN or Inf; refusing to quantize it")
    rows = g.reshape(g.shape[0], -1) if g.dim() > 1 else g.reshape(1, -1)
    return rows.float()


def fused_kernels(t: torch.Tensor):
    """:mod:`.channel_triton` when its fused encode serves ``t`` (a CUDA tensor, triton
    importable), else ``None``. Imported on the first CUDA tensor: triton is optional, and a
    CPU run never loads it."""
    if t.device.type != "cuda":
        return None
    from lowbit_strategy.codecs import channel_triton

    return channel_triton if channel_triton.serves(t) else None


def channel_encode(g: torch.Tensor, bits: int, *, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``g`` row-wise into (codes, scales).

    ``validate=False`` skips the NaN/Inf scan (a host sync) for callers that have excluded
    non-finite input already, as the BitDP hook does for a whole bucket at once.

    ``codes`` is uint8 of ``g.numel()`` lane values (row-major), ``scales`` float32 with
    one entry per row (dim 0; a 1-D tensor is a single row).
    """
    bits = _check_bits(bits)
    codes, scales, _ = _encode(_as_rows(g, validate), bits, decode=False)
    return codes, scales


def _check_bits(bits: int) -> int:
    if bits not in (1, 2):
        raise ValueError(f"BitDP bits must be 1 or 2, got {bits!r}")
    return bits


def _encode(rows: torch.Tensor, bits: int, decode: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(codes, scales, decoded or None)`` of float32 ``rows``: on CUDA the fused kernels of
    :mod:`.channel_triton` (the same bits, two launches instead of ~20), else the torch code.
    Codes are not differentiable: ``rows`` are detached, as the CPU's sliced path always was."""
    rows = rows.detach()
    fused = fused_kernels(rows)
    if fused is not None and rows.shape[1] < fused.MAX_COLS:
        mag = rows.abs()
        return fused.channel_encode(rows, mag, mag.mean(dim=1), bits, decode, THRESHOLD_FACTOR)
    codes, scales = _encode_torch(rows, bits)
    return codes, scales, channel_decode(codes, scales, bits) if decode else None


def _encode_torch(rows: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    if bits == 2 and compiled.compiled_enabled():  # opt-in: the same codes and scales, compiled (compiled.py)
        encoded = compiled.channel_ternary(rows, THRESHOLD_FACTOR, _mean_abs_sliced, _scales)
        if encoded is not None:
            return encoded
    if not sliced(rows):
        mag = rows.abs()
        mean_abs = mag.mean(dim=1)
        if bits == 1:
            return compare_bytes(torch.ge, rows, 0).reshape(-1), mean_abs
        codes = torch.empty(rows.shape, dtype=torch.uint8, device=rows.device)
        kept_count, kept_sum = _ternary(rows, mag, mean_abs, codes)
        return codes.reshape(-1), _scales(kept_count, kept_sum)
    if bits == 1:
        return compare_bytes(torch.ge, rows, 0).reshape(-1), _mean_abs_sliced(rows.detach())
    return _ternary_sliced(rows.detach())  # out= buffers: no autograd graph


def channel_encode_many(
    mats: Sequence[torch.Tensor], bits: int, *, decode: bool = False, validate: bool = True
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """:func:`channel_encode` of every matrix of ``mats`` (each as ``channel_encode`` sees it:
    dim 0 rows, the rest flattened), with about the torch calls of one: a run of consecutive
    contiguous matrices of the same width, two rows or more each, is encoded as one stack of
    rows. With ``decode``, also each one's :func:`channel_decode` (float32, its rows' shape),
    from one decode per run. Returns ``(codes, scales, decoded or None)`` per matrix, views into its
    run's tensors.

    Why: a bucket holds tens of matrices (48 in GPT-2 small), and ~20 small torch calls per
    matrix left the encode bound by the host on a GPU (the one-GPU check, part 4).

    The same codes and scales as encoding each matrix alone on the CPU: every operation is
    elementwise or a reduction along whole rows, and torch reduces a row in the same order in
    any call of two rows or more (:mod:`.streaming`; a one-row or strided matrix is encoded
    alone). On CUDA the reduction's launch configuration may follow the number of rows, so a
    row's scale can differ from its lone encoding in rounding; every rank stacks the same
    runs, so ranks agree."""
    _check_bits(bits)
    runs: list[list[torch.Tensor]] = []
    for m in mats:
        rows = _as_rows(m, validate)
        run = runs[-1] if runs else None
        if run and _stacks(run[-1]) and _stacks(rows) and run[-1].shape[1] == rows.shape[1]:
            run.append(rows)
        else:
            runs.append([rows])
    out: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
    for run in runs:
        stack = run[0] if len(run) == 1 else _adjacent(run)
        stack = torch.cat(run) if stack is None else stack
        codes, scales, decoded = _encode(stack, bits, decode)
        r0 = 0
        for rows in run:
            r, c = rows.shape
            dec = None if decoded is None else decoded[r0 : r0 + r]
            out.append((codes[r0 * c : (r0 + r) * c], scales[r0 : r0 + r], dec))
            r0 += r
    return out


def follows(prev: torch.Tensor, nxt: torch.Tensor) -> bool:
    """Whether ``nxt`` starts where ``prev`` ends in the same storage, with the same dtype: two
    contiguous tensors so placed read as one (a flat buffer's consecutive matrices, a stack's
    codes)."""
    return (
        nxt.dtype == prev.dtype
        and nxt.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
        and nxt.storage_offset() == prev.storage_offset() + prev.numel()
    )


def _adjacent(run: list[torch.Tensor]) -> torch.Tensor | None:
    """The run's rows as one view when they lie back to back in one storage (a flat buffer's
    consecutive matrices), else None (they are concatenated)."""
    if not all(follows(a, b) for a, b in zip(run, run[1:])):
        return None
    first = run[0]
    return first.as_strided((sum(r.shape[0] for r in run), first.shape[1]), (first.shape[1], 1))


def _stacks(rows: torch.Tensor) -> bool:
    """Whether ``rows`` may join a stack: two rows or more, and contiguous (torch reduces a
    strided row, a transposed weight's, in another order than a contiguous one)."""
    return rows.shape[0] > 1 and rows.is_contiguous()


def _ternary(
    rows: torch.Tensor, mag: torch.Tensor, mean_abs: torch.Tensor, codes: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """2-bit codes of Eq. 7 written into ``codes`` (uint8, ``rows``' shape), and per row the
    count and the sum of the kept magnitudes (Eq. 4's numerator and denominator), given
    ``mag = |rows|`` (consumed here) and its row means.

    Same values as the textbook bool masks, ``kept.sum(dim=1)`` and
    ``(mag * kept).sum(dim=1)``, but on CPU bool is the slow dtype: the masks are made as
    0/1 bytes (:func:`~lowbit_strategy.codecs.signs.compare_bytes`), the count sums them
    into int32 (a bool -> int64 reduction takes a casting path ~40x slower), and the kept
    magnitudes overwrite ``mag`` (multiplied by 0/1 bytes) instead of filling a new buffer.
    ``plus`` and ``minus`` are disjoint (α >= 0), so ``plus + 2·minus`` is the code and
    ``plus | minus`` the kept mask.

    ``mask`` (float32, ``rows``' shape; rows shorter than 2**24): a buffer for the kept mask
    as 0.0/1.0, so that the product with ``mag`` is float by float (the uint8 operand takes
    a mixed-dtype path) and the count is a float sum of 0/1 (exact below 2**24, in any
    order) instead of a cast of every byte to int32 and an integer sum.
    """
    alpha = (THRESHOLD_FACTOR * mean_abs).unsqueeze(1)
    plus = compare_bytes(torch.ge, rows, alpha)
    minus = compare_bytes(torch.lt, rows, -alpha)
    torch.add(plus, minus, out=codes).add_(minus)  # TERNARY_PLUS = 1, TERNARY_MINUS = 2 (alpha= is ~20x slower)
    kept = plus.bitwise_or_(minus)
    if mask is not None and rows.shape[1] < 2**24:
        kept = mask.copy_(kept)
        return kept.sum(dim=1).int(), mag.mul_(kept).sum(dim=1)
    count_dtype = torch.int32 if rows.shape[1] < 2**31 else torch.int64
    return kept.sum(dim=1, dtype=count_dtype), mag.mul_(kept).sum(dim=1)


def _scales(kept_count: torch.Tensor, kept_sum: torch.Tensor) -> torch.Tensor:
    """Eq. 4: the mean kept magnitude of every row, 0 for a row with nothing kept."""
    kept_count = kept_count.long()
    return torch.where(kept_count > 0, kept_sum / kept_count.clamp(min=1), torch.zeros_like(kept_sum))


def _row_buffer(rows: torch.Tensor) -> torch.Tensor:
    """A float32 buffer for the largest slice of :func:`.streaming.row_slices` of ``rows``."""
    r, c = rows.shape
    return torch.empty(min(r * c, max(SLICE, 3 * c)), dtype=torch.float32, device=rows.device)


def _mean_abs_sliced(rows: torch.Tensor) -> torch.Tensor:
    """``rows.abs().mean(dim=1)`` on slices of whole rows (:func:`.streaming.row_slices`)
    through one reused buffer: the same per-row sums, no full-size ``|rows|``."""
    r, c = rows.shape
    mean_abs = torch.empty(r, dtype=torch.float32, device=rows.device)
    buf = _row_buffer(rows)
    for lo, hi in row_slices(r, c):
        mag = torch.abs(rows[lo:hi], out=buf[: (hi - lo) * c].view(hi - lo, c))
        torch.mean(mag, dim=1, out=mean_abs[lo:hi])
    return mean_abs


def _ternary_sliced(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-bit encoder on slices of whole rows (:func:`.streaming.row_slices`): every row
    goes through the same operations (its reductions along whole rows, in calls of two rows
    or more), so the same codes and scales, with the temporaries in the cache."""
    r, c = rows.shape
    codes = torch.empty(r, c, dtype=torch.uint8, device=rows.device)
    kept_count = torch.empty(r, dtype=torch.int32 if c < 2**31 else torch.int64, device=rows.device)
    kept_sum = torch.empty(r, dtype=torch.float32, device=rows.device)
    buf, mask = _row_buffer(rows), _row_buffer(rows)
    for lo, hi in row_slices(r, c):
        part = rows[lo:hi]
        mag = torch.abs(part, out=buf[: (hi - lo) * c].view(hi - lo, c))
        kept = mask[: (hi - lo) * c].view(hi - lo, c)
        kept_count[lo:hi], kept_sum[lo:hi] = _ternary(part, mag, mag.mean(dim=1), codes[lo:hi], kept)
    return codes.reshape(-1), _scales(kept_count, kept_sum)


def channel_decode(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Dequantize lane values to float32 rows: ``scale_i * q_ij``, shape (rows, cols)."""
    _check_bits(bits)
    rows = scales.numel()
    if rows == 0 or codes.numel() % rows:
        raise ValueError(f"{codes.numel()} codes do not split into {rows} rows")
    q = codes.reshape(rows, -1)
    if bits == 1:
        signed = q.float() * 2 - 1
    else:
        signed = (q == TERNARY_PLUS).float() - (q == TERNARY_MINUS).float()
    return signed * scales.float().unsqueeze(1)
