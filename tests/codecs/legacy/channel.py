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

import torch

from tests.codecs.legacy.lp import all_finite
from tests.codecs.legacy.signs import compare_bytes

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


def channel_encode(g: torch.Tensor, bits: int, *, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode ``g`` row-wise into (codes, scales).

    ``validate=False`` skips the NaN/Inf scan (a host sync) for callers that have excluded
    non-finite input already, as the BitDP hook does for a whole bucket at once.

    ``codes`` is uint8 of ``g.numel()`` lane values (row-major), ``scales`` float32 with
    one entry per row (dim 0; a 1-D tensor is a single row).
    """
    if bits not in (1, 2):
        raise ValueError(f"BitDP bits must be 1 or 2, got {bits!r}")
    rows = _as_rows(g, validate)
    mag = rows.abs()
    mean_abs = mag.mean(dim=1)
    if bits == 1:
        return compare_bytes(torch.ge, rows, 0).reshape(-1), mean_abs
    return _ternary(rows, mag, mean_abs)


def _ternary(rows: torch.Tensor, mag: torch.Tensor, mean_abs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """2-bit codes and scales of Eq. 7 and Eq. 4, given ``mag = |rows|`` (consumed here).

    Same values as the textbook bool masks, ``kept.sum(dim=1)`` and
    ``(mag * kept).sum(dim=1)``, but on CPU bool is the slow dtype: the masks are made as
    0/1 bytes (:func:`~lowbit_strategy.codecs.signs.compare_bytes`), the count sums them
    into int32 (a bool -> int64 reduction takes a casting path ~40x slower), and the kept
    magnitudes overwrite ``mag`` (multiplied by 0/1 bytes) instead of filling a new buffer.
    """
    alpha = (THRESHOLD_FACTOR * mean_abs).unsqueeze(1)
    plus = compare_bytes(torch.ge, rows, alpha)
    minus = compare_bytes(torch.lt, rows, -alpha)
    kept = plus | minus
    count_dtype = torch.int32 if rows.shape[1] < 2**31 else torch.int64
    kept_count = kept.sum(dim=1, dtype=count_dtype).long()
    kept_sum = mag.mul_(kept).sum(dim=1)
    scales = torch.where(kept_count > 0, kept_sum / kept_count.clamp(min=1), torch.zeros_like(kept_sum))
    codes = plus * TERNARY_PLUS
    codes.add_(minus, alpha=TERNARY_MINUS)
    return codes.reshape(-1), scales


def channel_decode(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """Dequantize lane values to float32 rows: ``scale_i * q_ij``, shape (rows, cols)."""
    if bits not in (1, 2):
        raise ValueError(f"BitDP bits must be 1 or 2, got {bits!r}")
    rows = scales.numel()
    if rows == 0 or codes.numel() % rows:
        raise ValueError(f"{codes.numel()} codes do not split into {rows} rows")
    q = codes.reshape(rows, -1)
    if bits == 1:
        signed = q.float() * 2 - 1
    else:
        signed = (q == TERNARY_PLUS).float() - (q == TERNARY_MINUS).float()
    return signed * scales.float().unsqueeze(1)
