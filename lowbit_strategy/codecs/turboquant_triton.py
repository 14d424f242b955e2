"""Fused Triton kernels for the TurboQuant codec (``TurboQuantCodec(backend="triton")``).

The torch path of :mod:`.turboquant` makes about fifteen passes over memory per encode
(sign multiply, ten butterfly passes, RMS, divide, one compare per midpoint, pack) and as
many per decode. These kernels do each direction in one pass: a program loads a tile of
whole rotation blocks into registers and does everything there.

* **encode** (:func:`encode_blocks`): load (fp16/bf16/fp32, converted to fp32 exactly),
  sign flip, blocked Walsh–Hadamard butterfly, multiply by ``1/sqrt(block)``, the block's
  RMS scale (or a given one), divide by the scale, nearest level, pack into the bytes of
  :func:`.bits.pack` (2, 4 or 8-bit lanes, little-endian within a byte).
* **decode** (:func:`decode_blocks`): unpack, level lookup, multiply by the scale,
  butterfly, multiply by ``1/sqrt(block)``, sign flip, convert to the output dtype, store.

**Bit-exact against the torch backend** (same code bytes, same decoded bits). Every float
operation happens in the same order and with the same rounding as in the torch code:

* the signs are ±1, so multiplying by them is an exact sign flip (done here with a select);
* butterfly passes ``h = 1, 2, 4, …`` with ``a + b`` and ``a − b`` of the same pairs as
  :func:`.hadamard._fwht_rows` (a "constant geometry" formulation: every pass pairs
  neighbouring elements and writes sums to the first half, differences to the second,
  which after ``log2(block)`` passes leaves the result in natural order), then one multiply
  by ``float32(1 / sqrt(block))``;
* the division by the scale is IEEE round-to-nearest (``tl.math.div_rn``: Triton's ``/``
  may compile to an approximate division), the square root likewise (``sqrt_rn``), and
  floating-point contraction (mul + add → FMA) is turned off at launch
  (``enable_fp_fusion=False``): otherwise the RMS tree's first fold ``a·a + b·b`` compiles to an
  FMA (and ``level · scale`` followed by a butterfly add could);
* the level index is the number of midpoints strictly below ``z``, as in the torch code
  (one comparison per midpoint up to 4 bits, a branch-free binary search over the sorted
  midpoints above);
* conversions to fp16/bf16 round to nearest even, as ``Tensor.to`` does (bf16 by integer
  arithmetic on the float32 bits, c10's formula, NaN → 0x7FC0: the interpreter's own cast
  truncates);
* the RMS square root is IEEE-correctly rounded on both sides (see below).

**The RMS rule.** A reduction's result depends on its order, and torch's own reductions
(``vector_norm``, ``sum``) have an order that differs between CPU and CUDA and that Triton
cannot reproduce. So the codec's RMS of a full block is defined by an explicit order that
both backends compute: square every element, then fold in halves (``s[i] = s[i] + s[i +
W/2]`` for ``i < W/2``, ``W = block, block/2, …, 2``: ``log2(block)`` levels), then
``sqrt(s[0] · (1/block))`` (``1/block`` is a power of two: exact) correctly rounded to
float32. The torch backend computes the same folds as in-place adds of contiguous halves
(:func:`.turboquant_torch.group_rms`) and
takes the square root in float64, rounded once to float32 — torch's float32 ``sqrt`` on CPU
is sometimes one ulp off, and a float64 square root (even one ulp off) of a float32 value,
rounded to float32, is the correctly rounded result; the kernel uses ``sqrt_rn``. The
partial last group (a tail) keeps ``vector_norm``: the torch code does it on both backends.

**What runs where.** The kernels cover the *full* blocks (all of them, except the last one
when ``block == 2`` with 2-bit lanes and an odd count, so that the kernel's bytes end on a
byte boundary); whatever follows (the tail of ``n mod block`` elements and its power-of-two
pieces) is encoded/decoded by the torch code, which gives the same bits by definition.
Blocks larger than :data:`MAX_FUSED_BLOCK` elements do not fit in registers: the codec
uses the torch path for them.

**Checked where.** CI compares the backends bit for bit with the kernels in Triton's CPU
interpreter (``tests/codecs/test_turboquant_triton.py``); on a machine with CUDA the same
file also compiles them and compares on the GPU (``test_cuda_bit_exact``). Without a GPU,
``test_compiled_ptx_rounds_like_torch`` compiles them for an H100 (sm_90) and checks the
PTX: ``div.rn``/``sqrt.rn``, no approximate division or square root, no ``.ftz``, no FMA.

**Interpreter.** With ``TRITON_INTERPRET=1`` set *before this module is first imported*,
the kernels run on CPU tensors in Triton's numpy interpreter (slow: for tests); the mode is
fixed at import (:data:`INTERPRETED`), so one process runs either interpreted or compiled
kernels. The kernels call no libdevice function (whose variants Triton builds with
flush-to-zero), and the compiled PTX holds no ``.ftz`` instruction: subnormals are kept, as
in torch.

Import cost: this module imports ``triton`` (optional: ``pip install
"lowbit-strategy[triton]"``); :mod:`.turboquant` imports it only when a Triton backend is
used. :data:`AVAILABLE` says whether triton could be imported.
"""

from __future__ import annotations

import math

import torch

from lowbit_strategy.codecs.triton_launch import (  # noqa: F401  triton, tl, IMPORT_ERROR: this module's API too
    AVAILABLE,
    IMPORT_ERROR,
    LAUNCH,
    interpret_mode,
    on_device,
    tl,
    triton,
)

#: whether the kernels were built for Triton's CPU interpreter (``TRITON_INTERPRET=1`` at import)
INTERPRETED = interpret_mode()

#: largest rotation block the fused kernels take (a tile lives in registers)
MAX_FUSED_BLOCK = 8192
#: elements per program at least (several small blocks share a program)
_MIN_TILE = 1024


def _tile(block: int) -> tuple[int, int]:
    """(blocks per program, num_warps) for ``block``."""
    rows = max(1, _MIN_TILE // block)
    tile = rows * block
    return rows, min(16, max(4, tile // 256))


if AVAILABLE:

    @triton.jit
    def _fwht(x, R: tl.constexpr, B: tl.constexpr, LOG2B: tl.constexpr):
        """Unnormalized Walsh–Hadamard butterfly along axis 1 of an (R, B) fp32 tile, passes
        h = 1, 2, 4, … as in ``_fwht_rows``: each pass pairs neighbours (2i, 2i+1) — which
        after the previous passes are the elements ``h`` apart in the original order — and
        writes a + b to i and a − b to i + B/2."""
        for _ in tl.static_range(LOG2B):
            a, b = tl.split(tl.reshape(x, (R, B // 2, 2)))
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (R, B))
        return x

    @triton.jit
    def _sign_flip(x, sgn_ptr, offs, mask):
        """``x · D``: bit ``i % 8`` of byte ``i // 8`` set means the sign at ``i`` is −1.

        The sign bit is flipped with an integer XOR, which is what torch's multiply by −1
        does to every non-NaN float, +0.0 included. ``tl.where(neg, -x, x)`` compiled (sm_90,
        Triton 3.6) to an ``FSEL`` with a negated operand that gave +0.0 for −(+0.0): on an
        H100, 32 of 120 decoded payloads differed from torch's in signed zeros only."""
        byte = tl.load(sgn_ptr + (offs >> 3), mask=mask, other=0).to(tl.uint32)
        flip = ((byte >> (offs & 7).to(tl.uint32)) & 1) << 31
        return (x.to(tl.uint32, bitcast=True) ^ flip).to(tl.float32, bitcast=True)

    @triton.jit
    def _encode_kernel(
        x_ptr,
        sgn_ptr,
        scale_in_ptr,
        mids_ptr,
        codes_ptr,
        scale_out_ptr,
        nblocks,
        nbytes,
        inv_sqrt_b,
        inv_b,
        R: tl.constexpr,
        B: tl.constexpr,
        LOG2B: tl.constexpr,
        ROTATE: tl.constexpr,
        SCALE_MODE: tl.constexpr,
        BITS: tl.constexpr,
        LANE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * R + tl.arange(0, R)
        rmask = rows < nblocks
        offs = rows[:, None] * B + tl.arange(0, B)[None, :]
        mask = rmask[:, None] & (offs >= 0)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ROTATE:
            x = _sign_flip(x, sgn_ptr, offs, mask)
            x = _fwht(x, R, B, LOG2B) * inv_sqrt_b
        if SCALE_MODE == 0:  # RMS: squares folded in halves, s[i] += s[i + W/2], then sqrt(sum / B)
            sq = x * x
            for _ in tl.static_range(LOG2B):
                # (R, W) -> (R, 2, W/2), summed over the pair axis: s[:, i] + s[:, W/2 + i], one
                # add each (the same bits in either order); 13 shared-memory loads in the sm_90
                # PTX against 41 for the split(permute()) form it replaces. The encode kernel
                # measured ~30x slower than torch on an H100 (turboquant.py, ``backend``)
                sq = tl.sum(tl.reshape(sq, (R, 2, sq.shape[1] // 2)), axis=1)
            s = tl.math.sqrt_rn(tl.reshape(sq, (R,)) * inv_b)
            tl.store(scale_out_ptr + rows, s, mask=rmask)
        elif SCALE_MODE == 1:  # one scale for every block
            s = tl.load(scale_in_ptr + rows * 0)
        else:  # one scale per block
            s = tl.load(scale_in_ptr + rows, mask=rmask, other=1.0)
        safe = tl.where(s == 0.0, 1.0, s)
        z = tl.math.div_rn(x, tl.broadcast_to(safe[:, None], (R, B)))
        # level index: the number of midpoints strictly below z
        if BITS <= 4:
            idx = tl.zeros((R, B), dtype=tl.int32)
            for k in tl.static_range((1 << BITS) - 1):
                idx += (z > tl.load(mids_ptr + k)).to(tl.int32)
        else:
            idx = tl.zeros((R, B), dtype=tl.int32)
            for k in tl.static_range(BITS):  # steps 2**(BITS-1), ..., 2, 1
                m = tl.load(mids_ptr + idx + ((1 << (BITS - 1 - k)) - 1))
                idx = tl.where(z > m, idx + (1 << (BITS - 1 - k)), idx)
        # pack K = 8 // LANE codes per byte, code j of a byte at bit j * LANE
        K: tl.constexpr = 8 // LANE
        NB: tl.constexpr = R * B // K
        grp = tl.reshape(idx, (NB, K))
        shifts = tl.arange(0, K) * LANE
        byte = tl.sum(grp << shifts[None, :], axis=1)
        bidx = pid.to(tl.int64) * NB + tl.arange(0, NB)
        tl.store(codes_ptr + bidx, byte.to(tl.uint8), mask=bidx < nbytes)

    @triton.jit
    def _decode_kernel(
        codes_ptr,
        sgn_ptr,
        scale_ptr,
        levels_ptr,
        out_ptr,
        nblocks,
        inv_sqrt_b,
        R: tl.constexpr,
        B: tl.constexpr,
        LOG2B: tl.constexpr,
        ROTATE: tl.constexpr,
        SHARED_SCALE: tl.constexpr,
        LANE: tl.constexpr,
        OUT_BF16: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * R + tl.arange(0, R)
        rmask = rows < nblocks
        offs = rows[:, None] * B + tl.arange(0, B)[None, :]
        mask = rmask[:, None] & (offs >= 0)
        K: tl.constexpr = 8 // LANE
        byte = tl.load(codes_ptr + offs // K, mask=mask, other=0).to(tl.int32)
        code = (byte >> ((offs % K) * LANE).to(tl.int32)) & ((1 << LANE) - 1)
        y = tl.load(levels_ptr + code)
        if SHARED_SCALE:
            s = tl.load(scale_ptr + rows * 0)
        else:
            s = tl.load(scale_ptr + rows, mask=rmask, other=1.0)
        y = y * tl.broadcast_to(s[:, None], (R, B))
        if ROTATE:
            y = _fwht(y, R, B, LOG2B) * inv_sqrt_b
            y = _sign_flip(y, sgn_ptr, offs, mask)
        if OUT_BF16:  # round to nearest even by hand: the interpreter's cast truncates
            u = y.to(tl.uint32, bitcast=True)
            r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
            r = tl.where(y != y, 0x7FC0, r)
            tl.store(out_ptr + offs, r.to(tl.uint16).to(tl.int16, bitcast=True), mask=mask)
        else:
            tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _require() -> None:
    if not AVAILABLE:
        raise ImportError(
            'TurboQuantCodec(backend="triton") needs triton: pip install "lowbit-strategy[triton]" '
            f"(import failed: {IMPORT_ERROR})"
        )


def check_device(device: torch.device) -> None:
    """Raise unless the kernels can run on ``device`` (CUDA, or CPU under the interpreter)."""
    _require()
    if INTERPRETED:
        if device.type != "cpu":
            raise RuntimeError(
                f'TurboQuantCodec(backend="triton"): the kernels were built for Triton\'s CPU '
                f"interpreter (TRITON_INTERPRET=1 when turboquant_triton was imported); got a "
                f"tensor on {device}. Unset TRITON_INTERPRET for GPU runs."
            )
    elif device.type != "cuda":
        raise RuntimeError(
            f'TurboQuantCodec(backend="triton") needs a CUDA tensor, got one on {device}; use '
            'backend="torch" (or "auto") on the CPU, or set TRITON_INTERPRET=1 before the first '
            "import of lowbit_strategy.codecs.turboquant_triton to run the kernels in Triton's "
            "interpreter (slow; for tests)."
        )


def fused_blocks(n: int, block: int, lane_bits: int) -> int:
    """How many leading full blocks of an ``n``-element tensor the kernels handle: all full
    blocks, less one when their codes would not end on a byte boundary (``block == 2``
    with 2-bit lanes and an odd count); 0 when ``block`` exceeds :data:`MAX_FUSED_BLOCK`."""
    if block > MAX_FUSED_BLOCK:
        return 0
    q = n // block
    per_byte = 8 // lane_bits
    return q - 1 if (q * block) % per_byte else q


def sign_bits(signs: torch.Tensor) -> torch.Tensor:
    """The ±1 float ``signs`` as bits (1 = −1), 8 per byte, element ``i`` at bit ``i % 8`` of
    byte ``i // 8``: what the kernels read (1/32 of the float signs' memory traffic)."""
    from lowbit_strategy.codecs.bits import pack

    return pack((signs < 0).to(torch.uint8), 1, validate=False)


def encode_blocks(
    x: torch.Tensor,
    nblocks: int,
    block: int,
    *,
    sign_bits: torch.Tensor | None,
    scales: torch.Tensor | None,
    midpoints: torch.Tensor,
    bits: int,
    lane_bits: int,
    codes_out: torch.Tensor,
    scales_out: torch.Tensor | None,
) -> None:
    """Encode the first ``nblocks * block`` elements of flat contiguous ``x`` (fp16, bf16 or
    fp32) into ``codes_out[: nblocks * block // (8 // lane_bits)]``.

    ``sign_bits``: from :func:`sign_bits` (``None``: no rotation). ``scales``: ``None``
    (the RMS rule; written to ``scales_out[:nblocks]``), one value (shared) or at least
    ``nblocks`` values (float32). ``midpoints``: the codebook's float32 midpoints.
    """
    if nblocks == 0:
        return
    rows, warps = _tile(block)
    log2b = block.bit_length() - 1
    mode = 0 if scales is None else 1 if scales.numel() == 1 else 2
    dummy = midpoints
    grid = (triton.cdiv(nblocks, rows),)
    with on_device(x):
        _encode_kernel[grid](
            x,
            sign_bits if sign_bits is not None else codes_out,
            scales if scales is not None else dummy,
            midpoints,
            codes_out,
            scales_out if scales_out is not None else dummy,
            nblocks,
            nblocks * block // (8 // lane_bits),
            1.0 / math.sqrt(block),
            1.0 / block,
            R=rows,
            B=block,
            LOG2B=log2b,
            ROTATE=sign_bits is not None,
            SCALE_MODE=mode,
            BITS=bits,
            LANE=lane_bits,
            num_warps=warps,
            **LAUNCH,
        )


def decode_blocks(
    codes: torch.Tensor,
    nblocks: int,
    block: int,
    *,
    sign_bits: torch.Tensor | None,
    scales: torch.Tensor,
    levels: torch.Tensor,
    lane_bits: int,
    out: torch.Tensor,
) -> None:
    """Decode the first ``nblocks * block`` elements into flat contiguous ``out`` (fp16,
    bf16, fp32 or fp64). ``scales``: one value (shared) or at least ``nblocks`` (float32)."""
    if nblocks == 0:
        return
    rows, warps = _tile(block)
    grid = (triton.cdiv(nblocks, rows),)
    with on_device(codes):
        _decode_kernel[grid](
            codes,
            sign_bits if sign_bits is not None else codes,
            scales,
            levels,
            out.view(torch.int16) if out.dtype == torch.bfloat16 else out,
            nblocks,
            1.0 / math.sqrt(block),
            R=rows,
            B=block,
            LOG2B=block.bit_length() - 1,
            ROTATE=sign_bits is not None,
            SHARED_SCALE=scales.numel() == 1,
            LANE=lane_bits,
            OUT_BF16=out.dtype == torch.bfloat16,
            num_warps=warps,
            **LAUNCH,
        )
