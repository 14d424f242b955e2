"""Low-bit all-gather + per-row scales: BitDP's Ultra-low Bit AllReduce (Sec. 3.2, Fig. 2).

A *payload* holds several gradient matrices, each channel-encoded (Sec. 3.1.2,
:func:`lowbit_strategy.codecs.channel_encode`) into 1- or 2-bit codes packed into uint8
words (Phase 1), plus one float32 scale per row. Packed sums would overflow (the paper's
reason for not using an integer allreduce), so the codes are **all-gathered** (Phase 2)
and every rank decodes and reduces all ranks' codes locally (Phase 3).

Reductions (the result is always an estimate of the *mean* gradient over P ranks):

* ``"mean"`` (default): the exact mean of the dequantized gradients,
  ``g = 1/P · Σ_r s_r ⊙ q_r``. Needs every rank's scales, so scales are all-gathered.
* ``"paper"``: Eq. 10, ``g_ar = 1/P ⊙ s_ar ⊙ q_ar`` with ``q_ar = Σ_r q_r`` (the reduced
  codes) and ``s_ar`` the scales synchronized by a full-precision AllReduce "in parallel"
  (two-stream synchronization). We read ``s_ar`` as the rank *mean* of the scales — the
  averaging AllReduce of Algorithm 1's full-precision branch; with the plain sum the
  result would be P times the mean gradient. So ``g = mean_r(s_r) ⊙ mean_r(q_r)``: it
  differs from the exact mean whenever ranks' scales differ. Scales are allreduced here.

Wire layout: matrix k's codes are packed on their own (zero-padded to whole words), then
concatenated; scales likewise in matrix order. Every rank must pass the same layout (DDP
buckets are identical across ranks). Bytes per rank: ``(P-1)·W`` for the codes, plus
``(P-1)·4R`` (gathered scales, "mean") or a ring allreduce of ``4R`` bytes ("paper").

Interleaved decode-and-reduce (Sec. 3.2, Phase 3): decoding all P ranks' codes of a whole
matrix at once would need ``P·numel`` floats. The paper interleaves decoding and summation
bit position by bit position on the GPU; here the bound comes from chunks: each matrix is
processed ``chunk_rows`` rows at a time, and inside a chunk every rank's codes are mapped to
±1/0 by one table lookup per byte, weighted, and reduced over the ranks in one
:func:`~lowbit_strategy.codecs.reduce.rank_sum`: a handful of kernels per chunk whatever P
(a loop over ranks would launch ~4·P per chunk: tens of thousands per step on a GPU at
P = 64). Peak extra memory is about ``8·P·chunk_rows·cols`` bytes (every rank's chunk as
floats, and the reduction's levels), independent of the matrix height; lower ``chunk_rows`` at large P. The reduction's
fixed order gives bit-identical results on every rank (replicas never drift apart).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd.profiler import record_function

from lowbit_strategy import _moved
from lowbit_strategy.codecs import bits as lanes
from lowbit_strategy.codecs.channel import TERNARY_MINUS, TERNARY_PLUS, TERNARY_ZERO, channel_encode_many, follows
from lowbit_strategy.codecs.reduce import divide, rank_sum
from lowbit_strategy.codecs.signs import fused_kernels
from lowbit_strategy.collectives import chain
from lowbit_strategy.collectives import group as g
from lowbit_strategy.validation import is_int

REDUCTIONS = ("mean", "paper")
assert (TERNARY_ZERO, TERNARY_PLUS) == (0, 1), "_signs relies on 2-bit codes 0 -> 0 and 1 -> +1"
#: Rows decoded per chunk by default: ~8·P·256·cols bytes extra (8 MiB per rank at cols = 4096).
DEFAULT_CHUNK_ROWS = 256


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or bits not in (1, 2):
        raise ValueError(f"bits: got {bits!r}; BitDP codes are 1- or 2-bit (Sec. 3.1.2), pass bits=1 or bits=2")
    return int(bits)


def check_reduction(reduction: str) -> str:
    """``reduction`` if it is one of :data:`REDUCTIONS`, else a ``ValueError`` naming the fix."""
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduction: got {reduction!r}; use 'mean' (exact mean of dequantized gradients) or "
            "'paper' (BitDP Eq. 10: mean of scales times mean of codes)"
        )
    return reduction


def check_chunk_rows(chunk_rows: int | None) -> int | None:
    """``chunk_rows`` if it is None (no chunking) or a positive int, else a ``ValueError``."""
    if chunk_rows is None:
        return None
    if not is_int(chunk_rows, 1):
        raise ValueError(
            f"chunk_rows: got {chunk_rows!r}; pass a positive number of rows decoded at a time "
            "(or None to decode whole matrices at once)"
        )
    return chunk_rows


@dataclass(frozen=True)
class PayloadLayout:
    """Where each matrix lives in a payload: shapes and word/scale/element offsets.

    Build it with :meth:`of`. ``words``, ``rows`` and ``numel`` are the totals: uint8 words
    of packed codes, float32 scales (one per row), and decoded elements.
    """

    bits: int
    shapes: tuple[tuple[int, int], ...]
    word_offsets: tuple[int, ...]
    row_offsets: tuple[int, ...]
    elem_offsets: tuple[int, ...]
    words: int
    rows: int
    numel: int

    @classmethod
    def of(cls, shapes: Sequence[tuple[int, int]], bits: int) -> PayloadLayout:
        spec = lanes.lane(_check_bits(bits))
        shapes = tuple((int(r), int(c)) for r, c in shapes)
        if not shapes or any(r < 1 or c < 1 for r, c in shapes):
            raise ValueError(f"a payload needs at least one non-empty (rows, cols) matrix, got {shapes}")
        w = r_ = e = 0
        wo, ro, eo = [], [], []
        for rows, cols in shapes:
            wo.append(w)
            ro.append(r_)
            eo.append(e)
            w += spec.words_for(rows * cols)
            r_ += rows
            e += rows * cols
        return cls(int(bits), shapes, tuple(wo), tuple(ro), tuple(eo), w, r_, e)


def matrix_shape(t: torch.Tensor) -> tuple[int, int]:
    """(rows, cols) of ``t`` as a channel matrix: rows = dim 0 (output features), the
    rest flattened; a 1-D tensor is one row (as :func:`channel_encode` treats it)."""
    if t.dim() == 0 or t.numel() == 0:
        raise ValueError(f"cannot treat a tensor of shape {tuple(t.shape)} as a channel matrix")
    rows = t.shape[0] if t.dim() > 1 else 1
    return rows, t.numel() // rows


def pack_payload(
    codes: Sequence[torch.Tensor], scales: Sequence[torch.Tensor], layout: PayloadLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate per-matrix lane codes (each packed on its own) and scales into one
    (uint8 words, float32 scales) payload laid out as ``layout``."""
    if len(codes) != len(layout.shapes) or len(scales) != len(layout.shapes):
        raise ValueError(f"layout has {len(layout.shapes)} matrices, got {len(codes)} codes / {len(scales)} scales")
    per = lanes.lane(layout.bits).per_word
    words = torch.cat([lanes.pack(run, layout.bits, validate=False) for run in _adjacent_runs(codes, per)])
    return words, torch.cat([s.reshape(-1).float() for s in scales])


def _adjacent_runs(codes: Sequence[torch.Tensor], per: int) -> list[torch.Tensor]:
    """``codes`` (flattened) joined into one view wherever consecutive ones lie back to back in
    one storage (a stack's matrices, :func:`~lowbit_strategy.codecs.channel_encode_many`) and
    each but the last fills whole words (``per`` codes): packing such a run at once gives the
    words of packing each alone, concatenated, with one pack's torch calls (a host-bound step
    on a GPU)."""
    runs: list[list[torch.Tensor]] = []
    for c in codes:
        c = c.reshape(-1)
        prev = runs[-1][-1] if runs else None
        if (
            prev is not None
            and prev.numel() % per == 0
            and prev.is_contiguous()
            and c.is_contiguous()
            and follows(prev, c)
        ):
            runs[-1].append(c)
        else:
            runs.append([c])
    return [r[0] if len(r) == 1 else r[0].as_strided((sum(c.numel() for c in r),), (1,)) for r in runs]


def encode(mats: Sequence[torch.Tensor], bits: int) -> tuple[PayloadLayout, torch.Tensor, torch.Tensor]:
    """Channel-encode every matrix (Eq. 5-9) and pack them: (layout, words, scales)."""
    layout = PayloadLayout.of([matrix_shape(m) for m in mats], bits)
    enc = channel_encode_many(mats, bits)
    words, scales = pack_payload([c for c, _, _ in enc], [s for _, s, _ in enc], layout)
    return layout, words, scales


_DECODE_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _decode_table(bits: int, device: torch.device) -> torch.Tensor:
    """(256, 8 / bits) float32: the codes of every byte value as ±1 (1-bit) or 0/+1/-1
    (2-bit), in the lane order of :func:`lowbit_strategy.codecs.bits.pack`."""
    key = (bits, device)
    table = _DECODE_TABLES.get(key)
    if table is None:
        per_byte = 8 // bits
        shifts = torch.arange(per_byte, device=device) * bits
        codes = (torch.arange(256, device=device).unsqueeze(1) >> shifts) & ((1 << bits) - 1)
        if bits == 1:
            table = codes.to(torch.float32) * 2 - 1
        else:  # codes 0 / 1 / 2 mean 0 / +1 / -1
            table = torch.where(codes == TERNARY_MINUS, -1.0, codes.to(torch.float32))
        table = _DECODE_TABLES.setdefault(key, table.contiguous())
    return table


def _signs(words: torch.Tensor, bits: int, start: int, n: int) -> torch.Tensor:
    """Codes ``start .. start+n`` of one packed matrix for every rank at once: ``words`` is
    ``(P, W)``, the result ``(P, n)`` float32 ±1 (1-bit) or ±1/0 (2-bit), one table lookup
    per byte (the same values the codes mean, exactly)."""
    k = lanes.lane(bits).per_word
    w0, w1 = start // k, -(-(start + n) // k)
    table = _decode_table(bits, words.device)
    rows = table.index_select(0, words[:, w0:w1].reshape(-1).to(torch.int32)).view(words.shape[0], -1)
    return rows[:, start - w0 * k : start - w0 * k + n]


def decode_reduce(
    words: torch.Tensor,
    scales: torch.Tensor,
    layout: PayloadLayout,
    *,
    reduction: str = "mean",
    chunk_rows: int | None = DEFAULT_CHUNK_ROWS,
    out: torch.Tensor | Sequence[torch.Tensor] | None = None,
) -> torch.Tensor | Sequence[torch.Tensor]:
    """Decode and reduce the gathered payload of P ranks (Phase 3), chunk by chunk.

    ``words``: (P, layout.words) uint8, every rank's packed codes. ``scales``: (P, rows)
    per-rank scales for ``"mean"``, or the rows-long rank mean ``s_ar`` for ``"paper"``.
    ``out``: None (returns a new flat float32 tensor of ``layout.numel``), a flat float32
    tensor of that length, or one float32 tensor per matrix (e.g. views into a DDP bucket);
    it is overwritten and returned.

    On CUDA (triton importable, P at most ``signs_triton.MAX_ROWS``) each matrix with a
    contiguous ``out`` is one fused kernel (:func:`~lowbit_strategy.codecs.signs_triton.channel_reduce`),
    the same floats with no (P, chunk, cols) temporaries, so ``chunk_rows`` does not apply
    there; the torch code below was a table gather per chunk, at ~1 % of a device copy on an
    H100.
    """
    check_reduction(reduction)
    check_chunk_rows(chunk_rows)
    if words.dim() != 2 or words.dtype != torch.uint8 or words.shape[1] != layout.words:
        raise ValueError(f"words must be (P, {layout.words}) uint8, got {tuple(words.shape)} {words.dtype}")
    p = words.shape[0]
    want = (p, layout.rows) if reduction == "mean" else (layout.rows,)
    if tuple(scales.shape) != want:
        raise ValueError(f"reduction={reduction!r} needs scales of shape {want}, got {tuple(scales.shape)}")
    if out is None:
        out = torch.empty(layout.numel, dtype=torch.float32, device=words.device)
    if isinstance(out, torch.Tensor):
        if out.numel() != layout.numel or out.dtype != torch.float32:
            raise ValueError(f"out must hold {layout.numel} float32 elements, got {out.numel()} {out.dtype}")
        flat = out.view(-1)
        mats = [flat[e : e + r * c] for e, (r, c) in zip(layout.elem_offsets, layout.shapes)]
    else:
        mats = list(out)
        if len(mats) != len(layout.shapes) or any(
            m.numel() != r * c or m.dtype != torch.float32 for m, (r, c) in zip(mats, layout.shapes)
        ):
            raise ValueError("out must be one float32 tensor per matrix, sized rows * cols")
    # "mean": fold 1/P into the scales once (R floats) instead of into every element.
    weights = divide(scales.float(), p)  # correctly rounded on CUDA too
    fused = fused_kernels(words)  # CUDA: one Triton pass per matrix, the same floats (signs_triton)
    if fused is not None and (p > fused.MAX_ROWS or words.stride(1) != 1):
        fused = None
    for k, (rows, cols) in enumerate(layout.shapes):
        w_off, r_off = layout.word_offsets[k], layout.row_offsets[k]
        mat_words = words[:, w_off : w_off + lanes.lane(layout.bits).words_for(rows * cols)]
        dest = mats[k].view(rows, cols)
        if fused is not None and dest.is_contiguous():
            mine = weights[:, r_off : r_off + rows] if reduction == "mean" else weights[r_off : r_off + rows]
            fused.channel_reduce(mat_words, mine, rows, cols, layout.bits, reduction == "mean", dest)
            continue
        step = rows if chunk_rows is None else chunk_rows
        for a in range(0, rows, step):
            b = min(rows, a + step)
            # every rank's codes of the chunk at once, then one reduction over the ranks
            # (rank_sum's fixed order: identical float sums on every rank)
            q = _signs(mat_words, layout.bits, a * cols, (b - a) * cols).view(p, b - a, cols)
            if reduction == "mean":
                dest[a:b] = rank_sum(q.mul_(weights[:, r_off + a : r_off + b].unsqueeze(-1)))  # exact products
            else:  # q_ar: exact integer sum of codes (Eq. 10), then 1/P · s_ar ⊙ q_ar
                dest[a:b] = rank_sum(q).mul_(weights[r_off + a : r_off + b].unsqueeze(1))
            del q
    return out


def _check_payload(words: torch.Tensor, scales: torch.Tensor, layout: PayloadLayout) -> None:
    if words.dtype != torch.uint8 or words.dim() != 1 or words.numel() != layout.words:
        raise ValueError(f"words must be 1-D uint8 of {layout.words} words, got {tuple(words.shape)} {words.dtype}")
    if scales.dtype != torch.float32 or scales.dim() != 1 or scales.numel() != layout.rows:
        raise ValueError(f"scales must be 1-D float32 of {layout.rows} rows, got {tuple(scales.shape)} {scales.dtype}")


def gathered_mean(
    words: torch.Tensor,
    scales: torch.Tensor,
    layout: PayloadLayout,
    group=None,
    *,
    reduction: str = "mean",
    chunk_rows: int | None = DEFAULT_CHUNK_ROWS,
    out=None,
    traffic=None,
) -> torch.Tensor | list[torch.Tensor]:
    """Blocking BitDP allreduce of this rank's payload; see :func:`decode_reduce` for ``out``.

    Returns the flat float32 mean gradient (or ``out``) on every rank: the value of
    :func:`gathered_mean_async`, waited for.
    """
    return gathered_mean_async(
        words, scales, layout, group, reduction=reduction, chunk_rows=chunk_rows, out=out, traffic=traffic
    ).wait()


def gathered_mean_async(
    words: torch.Tensor,
    scales: torch.Tensor,
    layout: PayloadLayout,
    group=None,
    *,
    reduction: str = "mean",
    chunk_rows: int | None = DEFAULT_CHUNK_ROWS,
    out=None,
    traffic=None,
    flag: torch.Tensor | None = None,
) -> torch.futures.Future:
    """Non-blocking :func:`gathered_mean`: both transfers start now (codes and scales in
    parallel, the two streams of Sec. 3.2); decode-and-reduce runs in a callback chained
    from the scales' collective (launched last), which first waits for the codes' own
    future: on NCCL only a collective's own ``wait()`` or a ``then`` chained from it is
    ordered after its data. The future resolves to the same value :func:`gathered_mean`
    returns.

    ``flag``: an optional device-side bool of this rank ("my input was non-finite"). It
    travels as one more float beside the scales, so every rank learns whether *any* rank
    raised it from data it has anyway, with no extra collective and no host sync at all.
    With a flag the future resolves to ``(result, any_flag)``, ``any_flag`` a 0-d bool
    tensor on the device, the same on every rank; where it is set, ``result`` is decoded
    from meaningless codes (the caller masks it: no host read decides anything here).
    """
    check_reduction(reduction)
    check_chunk_rows(chunk_rows)
    _check_payload(words, scales, layout)
    p, rows = g.world_size(group), layout.rows
    flagged = flag is not None
    if flag is not None:
        scales = torch.cat([scales, flag.to(torch.float32).reshape(1)])
    width = rows + flagged
    every = torch.empty(p * layout.words, dtype=torch.uint8, device=words.device)
    f_codes = g.all_gather_async(every, words, group, "gathered.codes.all_gather", traffic)
    if reduction == "mean":
        s = torch.empty(p * width, dtype=torch.float32, device=words.device)
        f_scales = g.all_gather_async(s, scales, group, "gathered.scales.all_gather", traffic)
    else:
        s = scales.clone()
        f_scales = g.all_reduce_sum_async(s, group, "gathered.scales.allreduce", traffic)

    def finish(_: torch.futures.Future):  # chained from the scales' collective: its data is there
        with record_function("lowbit.callback:gathered.decode"):  # (labelled in profiles)
            return decode()

    def decode():
        # the codes' own wait (launched first, gloo has taken it up already: no deadlock)
        f_codes.wait()
        if reduction == "mean":
            table = s.view(p, width)
            raised = table[:, rows].sum() > 0 if flagged else None
            scl = table[:, :rows]
        else:
            raised = s[rows] > 0 if flagged else None
            scl = s[:rows].div_(p)  # s_ar: rank mean
        result = decode_reduce(every.view(p, -1), scl, layout, reduction=reduction, chunk_rows=chunk_rows, out=out)
        return (result, raised) if flagged else result

    return chain.then(f_scales, finish)


#: ``Layout`` was renamed ``PayloadLayout`` (0.3: ``lowbit_strategy.layout.Layout`` is the optimizer's)
__getattr__ = _moved.attribute_aliases(__name__, {"Layout": "lowbit_strategy.collectives.gathered.PayloadLayout"})
