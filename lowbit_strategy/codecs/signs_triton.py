"""Fused Triton kernels for the packed 1-bit payloads on CUDA: decode, the server's mean, the
majority vote and the compress (signs, packing and error feedback), one pass each; and
BitDP's decode-and-reduce of 1- and 2-bit channel codes (:func:`channel_reduce`).

Why: on an H100 (the one-GPU check, part 2, 2^26 elements) the torch forms ran at 1-4 % of a
device-to-device copy. The decodes and the mean gather rows of small ``(256, 8)`` tables by
byte (``index_select``: CUDA's generic indexing kernel, 32 bytes per index), and the
majority's byte-lane count is ~56 small kernels per bucket. Here a program reads its bytes
(and the few scales they need) and writes its floats or bytes once.

**Bit for bit the torch codes** (:mod:`.scaled_signs_decode`, :mod:`.signs`, :mod:`.votes`),
by construction, and checked in Triton's interpreter by ``tests/codecs/test_signs_triton.py``
(on a GPU by the one-GPU check):

* decode: ``s · (±1)`` in float32, as the torch tables are built (exact; here the sign bit
  is flipped by an integer XOR, as a multiply by −1 flips it, signed zeros included), then
  rounded once to the output dtype: float16 by the conversion (round to nearest even on the
  GPU and in the interpreter), bfloat16 by c10's integer formula (the interpreter's own cast
  truncates), float64 exactly. The torch form for small scale blocks rounds the scale first
  and multiplies by ±1 in the output dtype: the same value, rounding being symmetric;
* mean (1-bit LAMB Algorithm 1, line 10): the terms ``w_r · (±1)`` are exact, and their sum
  follows :func:`~lowbit_strategy.codecs.reduce.rank_sum`'s pairwise tree. The rows are
  padded to a power of two with −0.0, which is the exact identity of IEEE addition (``x +
  (−0.0) = x`` for every ``x``, −0.0 included), so a row paired with padding is carried up
  unchanged, as ``rank_sum`` carries an odd last row, and the real rows meet in the same
  pairs at every level. The −0.0 is a kernel argument, not a constant: a constant −0.0 in a
  select compiled to ``FSEL …, -RZ`` on sm_90, which read +0.0 on an H100 (:func:`_pad`).
  The weights ``s_r / P`` come from :func:`~lowbit_strategy.codecs.reduce.divide`, correctly
  rounded on CUDA too. Each level adds explicit pairs (``split``), and floating-point
  contraction is off at launch (``enable_fp_fusion=False``);
* majority (Lion Cub Sec. 3): per bit, the count of +1 votes is an integer sum, exact in any
  order, compared with :func:`~lowbit_strategy.codecs.votes.majority_threshold`'s threshold.
* channel reduce (BitDP Sec. 3.1.2, Eq. 10; the torch code is
  :func:`~lowbit_strategy.collectives.gathered.decode_reduce`): 1- or 2-bit lane codes, rows
  of ``cols`` codes with one weight each; the terms ``q · w`` are exact (``q`` in {±1, 0}) and
  summed in the same pairwise tree as the mean; the ``"paper"`` reduction sums the integer
  codes (exact) and multiplies once by the row's weight.

**Where they run.** The codecs call them for CUDA tensors when triton imports
(:func:`.signs.fused_kernels`); everything else keeps the torch code. With
``TRITON_INTERPRET=1`` set before this module is first imported they run on CPU tensors in
Triton's interpreter instead (tests); the mode is fixed at import (:data:`INTERPRETED`).
"""

from __future__ import annotations

import torch

from lowbit_strategy.codecs.triton_launch import AVAILABLE, LAUNCH, interpret_mode, on_device, triton

if AVAILABLE:
    import triton.language as tl

#: whether the kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)
INTERPRETED = interpret_mode()
#: most rows (ranks) the mean and the majority kernels take in one program's registers;
#: more fall back to the torch code
MAX_ROWS = 256
#: elements per program of the decode
_DECODE_TILE = 1024
#: bytes (8 elements each) per program of the compress
_COMPRESS_BYTES = 128
#: a program's tile of the mean and the majority: rows x columns at most this
_ROW_TILE = 4096
#: output dtype codes of the decode kernel
_OUT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def serves(t: torch.Tensor) -> bool:
    """Whether these kernels can run on ``t``'s device: CUDA with compiled kernels, or the
    CPU under the interpreter."""
    return AVAILABLE and (t.device.type == "cpu" if INTERPRETED else t.device.type == "cuda")


def _pow2(k: int) -> int:
    return 1 << max(0, k - 1).bit_length()


if AVAILABLE:

    @triton.jit
    def _store(out_ptr, offs, y, mask, OUT: tl.constexpr):
        """``y`` (float32) rounded once to the output dtype (see the module docstring)."""
        if OUT == 2:  # bfloat16, round to nearest even by hand; out_ptr is its int16 view
            u = y.to(tl.uint32, bitcast=True)
            r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
            r = tl.where(y != y, 0x7FC0, r)
            tl.store(out_ptr + offs, r.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
        else:
            tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _signed(s, bit):
        """``s · (+1 if bit else −1)``: the sign bit flipped by an integer XOR where ``bit`` is
        0, which is what torch's multiply by −1 does to every non-NaN float, +0.0 included (a
        select of ``-s`` compiles to a negated-operand ``FSEL`` that turned −(+0.0) into +0.0 in
        TurboQuant's kernels on an H100)."""
        flip = ((1 - bit) << 31).to(tl.uint32)
        return (s.to(tl.uint32, bitcast=True) ^ flip).to(tl.float32, bitcast=True)

    @triton.jit
    def _pad(x, mask, neg_zero):
        """``x`` where ``mask``, else −0.0, the identity of the float sums below (``y + −0.0`` is
        ``y`` for every ``y``, signed zeros included). ``neg_zero`` is a kernel argument (the
        host passes −0.0), not a constant: LLVM turns a select of the constant −0.0, also one
        written on the integer bits, into a float select that ptxas encodes as ``FSEL …, -RZ``
        on sm_90, and that negated zero register reads +0.0 (an all-zero sum came out +0.0 on an
        H100 where torch gives −0.0). A register the compiler cannot see into is selected as is."""
        return tl.where(mask, x, neg_zero)

    @triton.jit
    def _decode_kernel(
        bits_ptr, scale_ptr, out_ptr, n, row_len, nb, block_bytes,
        TILE: tl.constexpr, BLOCKED: tl.constexpr, OUT: tl.constexpr,
    ):  # fmt: skip
        e = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
        mask = e < n
        byte = tl.load(bits_ptr + (e >> 3), mask=mask, other=0).to(tl.int32)
        bit = (byte >> (e & 7).to(tl.int32)) & 1
        row = e // row_len
        if BLOCKED:
            index = row * nb + ((e % row_len) >> 3) // block_bytes
        else:
            index = row
        s = tl.load(scale_ptr + index, mask=mask, other=0.0)
        _store(out_ptr, e, _signed(s, bit), mask, OUT)

    @triton.jit
    def _mean_kernel(
        bits_ptr, w_ptr, out_ptr, k, c, nb, block_bytes, neg_zero,
        KP: tl.constexpr, LOGK: tl.constexpr, TILE: tl.constexpr, BLOCKED: tl.constexpr,
    ):  # fmt: skip
        e = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
        r = tl.arange(0, KP).to(tl.int64)
        mask = (r < k)[:, None] & (e < 8 * c)[None, :]
        col = (e >> 3)[None, :]
        byte = tl.load(bits_ptr + r[:, None] * c + col, mask=mask, other=0).to(tl.int32)
        bit = (byte >> (e & 7).to(tl.int32)[None, :]) & 1
        if BLOCKED:
            index = r[:, None] * nb + col // block_bytes
        else:
            index = r[:, None] + col * 0
        w = tl.load(w_ptr + index, mask=mask, other=0.0)
        terms = _pad(_signed(w, bit), mask, neg_zero)  # -0.0: the identity
        for _ in tl.static_range(LOGK):  # rank_sum's levels: rows (2i, 2i + 1) -> i
            pairs = tl.permute(tl.reshape(terms, (terms.shape[0] // 2, 2, TILE)), (0, 2, 1))
            a, b = tl.split(pairs)
            terms = a + b
        tl.store(out_ptr + e, tl.reshape(terms, (TILE,)), mask=e < 8 * c)

    @triton.jit
    def _channel_kernel(
        words_ptr, w_ptr, out_ptr, k, n, cols, word_stride, w_stride, neg_zero,
        BITS: tl.constexpr, KP: tl.constexpr, LOGK: tl.constexpr, TILE: tl.constexpr, MEAN: tl.constexpr,
    ):  # fmt: skip
        e = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
        r = tl.arange(0, KP).to(tl.int64)
        mask = (r < k)[:, None] & (e < n)[None, :]
        per: tl.constexpr = 8 // BITS
        byte = tl.load(words_ptr + r[:, None] * word_stride + (e // per)[None, :], mask=mask, other=0).to(tl.int32)
        code = (byte >> ((e % per) * BITS).to(tl.int32)[None, :]) & ((1 << BITS) - 1)
        row = (e // cols)[None, :]
        if MEAN:  # the terms q·(s_r/P), exact: ±w by the sign bit, +0.0·w for a 0, 3·w for the unused 3
            w = tl.load(w_ptr + r[:, None] * w_stride + row, mask=mask, other=0.0)
            if BITS == 1:
                terms = _signed(w, code)
            else:
                terms = tl.where(code == 0, w * 0.0, tl.where(code == 3, w * 3.0, _signed(w, (code == 1).to(tl.int32))))
        else:  # the codes themselves (integers: their sum is exact), scaled after the sum
            if BITS == 1:
                terms = (2 * code - 1).to(tl.float32)
            else:
                terms = tl.where(code == 2, -1.0, code.to(tl.float32))
        terms = _pad(terms, mask, neg_zero)  # -0.0: the identity
        for _ in tl.static_range(LOGK):  # rank_sum's levels: rows (2i, 2i + 1) -> i
            pairs = tl.permute(tl.reshape(terms, (terms.shape[0] // 2, 2, TILE)), (0, 2, 1))
            a, b = tl.split(pairs)
            terms = a + b
        y = tl.reshape(terms, (TILE,))
        if not MEAN:
            y = y * tl.load(w_ptr + e // cols, mask=e < n, other=0.0)
        tl.store(out_ptr + e, y, mask=e < n)

    @triton.jit
    def _compress_kernel(
        v_ptr, scale_ptr, bits_ptr, n, nbytes, row_len, nb, block_bytes,
        TB: tl.constexpr, BLOCKED: tl.constexpr,
    ):  # fmt: skip
        j = tl.program_id(0).to(tl.int64) * TB + tl.arange(0, TB)  # the program's bytes
        e = j[:, None] * 8 + tl.arange(0, 8)[None, :]  # their elements, (TB, 8)
        mask = e < n
        v = tl.load(v_ptr + e, mask=mask, other=0.0)
        positive = (v >= 0) & mask  # zeros (either sign) count as +1; NaN and padding as 0
        shifts = tl.arange(0, 8)[None, :]
        tl.store(bits_ptr + j, tl.sum(positive.to(tl.int32) << shifts, axis=1).to(tl.uint8), mask=j < nbytes)
        if BLOCKED:
            index = (e // row_len) * nb + ((e % row_len) >> 3) // block_bytes
        else:
            index = e * 0
        s = tl.load(scale_ptr + index, mask=mask, other=0.0)
        # v − s·sign(v), one rounding; ±s by XOR, not a select of −s (:func:`_signed`)
        tl.store(v_ptr + e, v - _signed(s, positive.to(tl.int32)), mask=mask)

    @triton.jit
    def _majority_kernel(words_ptr, out_ptr, p, c, row_stride, threshold, PP: tl.constexpr, TB: tl.constexpr):
        j = tl.program_id(0).to(tl.int64) * TB + tl.arange(0, TB)
        r = tl.arange(0, PP).to(tl.int64)
        mask = (r < p)[:, None] & (j < c)[None, :]
        words = tl.load(words_ptr + r[:, None] * row_stride + j[None, :], mask=mask, other=0).to(tl.int32)
        byte = tl.zeros((TB,), dtype=tl.int32)
        for t in tl.static_range(8):
            count = tl.sum((words >> t) & 1, axis=0)
            byte |= (count >= threshold).to(tl.int32) << t
        tl.store(out_ptr + j, byte.to(tl.uint8), mask=j < c)


def decode(
    rows: torch.Tensor, scales: torch.Tensor, n: int, dtype: torch.dtype, block: int | None, out: torch.Tensor | None
) -> torch.Tensor:
    """:func:`.scaled_signs_decode.scaled_sign_decode` of checked ``rows`` ((k, c) uint8) and
    float32 ``scales`` ((k,), or (k, nb) with ``block``): the first ``n`` values, 1-D."""
    k, c = rows.shape
    if out is None:
        out = torch.empty(n, dtype=dtype, device=rows.device)
    if n == 0:
        return out
    grid = (triton.cdiv(n, _DECODE_TILE),)
    nb = scales.shape[1] if block is not None else 1
    with on_device(rows):
        _decode_kernel[grid](
            rows.contiguous(), scales.contiguous(), out.view(torch.int16) if dtype == torch.bfloat16 else out,
            n, 8 * c, nb, (block or 8) // 8,
            TILE=_DECODE_TILE, BLOCKED=block is not None, OUT=_OUT[dtype], **LAUNCH,
        )  # fmt: skip
    return out


def compress(v: torch.Tensor, scales: torch.Tensor, nbytes: int, block: int | None, chunk: int | None) -> torch.Tensor:
    """The bits and the error of :func:`.scaled_signs.scaled_sign_compress`, one pass: ``v``
    (float32, contiguous, ``x + error`` already) becomes ``v − s·sign(v)`` in place, and the
    packed signs (``nbytes``, bits past ``v``'s end 0) are returned. ``scales``: the 0-d scale,
    or with ``block`` the ``(rows, blocks per row)`` grid, rows of ``chunk`` elements (one row
    without ``chunk``). The torch code's values: a bit is ``v >= 0`` (zeros of either sign
    +1), and ``v + (−1·sign)·s`` is ``v ∓ s`` rounded once (the product is exact)."""
    n = v.numel()
    out = torch.empty(nbytes, dtype=torch.uint8, device=v.device)
    if nbytes == 0:
        return out
    row_len = chunk if chunk is not None else 8 * nbytes
    nb = scales.shape[-1] if block is not None else 1
    with on_device(v):
        _compress_kernel[(triton.cdiv(nbytes, _COMPRESS_BYTES),)](
            v, scales, out, n, nbytes, row_len, nb, (block or 8) // 8,
            TB=_COMPRESS_BYTES, BLOCKED=block is not None, **LAUNCH,
        )  # fmt: skip
    return out


def decodes(dtype: torch.dtype) -> bool:
    """Whether :func:`decode` writes ``dtype``."""
    return dtype in _OUT


def mean(rows: torch.Tensor, weights: torch.Tensor, block: int | None, out: torch.Tensor | None) -> torch.Tensor:
    """:func:`.scaled_signs_decode.scaled_sign_mean` of checked ``rows`` ((k, c) uint8, ``k``
    at most :data:`MAX_ROWS`) given the float32 ``weights = scales / k`` ((k,) or (k, nb))."""
    k, c = rows.shape
    if out is None:
        out = torch.empty(8 * c, dtype=torch.float32, device=rows.device)
    if c == 0:
        return out
    kp = _pow2(k)
    tile = max(16, _ROW_TILE // kp)
    nb = weights.shape[1] if block is not None else 1
    with on_device(rows):
        _mean_kernel[(triton.cdiv(8 * c, tile),)](
            rows.contiguous(), weights.contiguous(), out, k, c, nb, (block or 8) // 8, -0.0,
            KP=kp, LOGK=kp.bit_length() - 1, TILE=tile, BLOCKED=block is not None, **LAUNCH,
        )  # fmt: skip
    return out


def channel_reduce(
    words: torch.Tensor, weights: torch.Tensor, rows: int, cols: int, bits: int, mean: bool, out: torch.Tensor
) -> torch.Tensor:
    """One matrix of :func:`lowbit_strategy.collectives.gathered.decode_reduce` (BitDP's
    channel codes, Eq. 5-10): ``words`` ((P, W) uint8 rows with unit column stride, the
    matrix's packed lane codes; ``P`` at most :data:`MAX_ROWS`), ``weights`` the scales over
    P ((P, rows), rows with unit stride) for the ``"mean"`` reduction or the rank mean
    ``s_ar / P`` ((rows,)) for ``"paper"``; writes the (rows, cols) float32 result into the
    contiguous ``out``. Bit for bit the torch code: the same exact terms (or integer codes)
    summed in :func:`~lowbit_strategy.codecs.reduce.rank_sum`'s pairwise tree, then (paper)
    one multiply by the row's weight."""
    k, n = words.shape[0], rows * cols
    if n == 0:
        return out
    kp = _pow2(k)
    tile = max(16, _ROW_TILE // kp)
    w_stride = weights.stride(0) if mean else 0
    with on_device(words):
        _channel_kernel[(triton.cdiv(n, tile),)](
            words, weights, out, k, n, cols, words.stride(0), w_stride, -0.0,
            BITS=bits, KP=kp, LOGK=kp.bit_length() - 1, TILE=tile, MEAN=mean, **LAUNCH,
        )  # fmt: skip
    return out


def majority(words: torch.Tensor, threshold: int) -> torch.Tensor:
    """:func:`.votes.majority_bits` of (P, C) uint8 ``words`` (rows with unit column stride,
    ``P`` at most :data:`MAX_ROWS`) against ``threshold``: the (C,) packed winners."""
    p, c = words.shape
    out = torch.empty(c, dtype=torch.uint8, device=words.device)
    pp = _pow2(p)
    tb = max(16, _ROW_TILE // pp)
    with on_device(words):
        _majority_kernel[(triton.cdiv(c, tb),)](words, out, p, c, words.stride(0), threshold, PP=pp, TB=tb, **LAUNCH)
    return out
