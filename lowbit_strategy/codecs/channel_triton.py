"""Fused Triton kernels for BitDP's channel encode on CUDA (BitDP Sec. 3.1.2, Eq. 4-9): the
codes, the kept magnitudes and counts in one pass per row, then the scales and (for error
feedback) the decoded rows in a second.

Why: on an H100 (the one-GPU check, part 4) BitDP's encode took 25 ms and its server 37 ms
per GPT-2-small step, with the host issuing ~20 small torch operators per stack of equal-width
matrices (1,516 and 2,252 operator calls per step; the host's issue time within 5 % of the
measured time, so bound by the host, not the GPU). Here the elementwise chain of Eq. 7 and the
scale of Eq. 4 are two launches.

**Bit for bit the torch code** (:mod:`.channel`), by construction, and checked in Triton's
interpreter by ``tests/codecs/test_channel_triton.py`` (on a GPU by the one-GPU check):

* the row reductions stay torch's: the caller computes ``mean_abs = |rows|.mean(dim=1)`` as the
  torch code does, and sums the kept magnitudes this kernel writes back into that same ``|rows|``
  buffer (its strides, so the same reduction order) with ``sum(dim=1)``, as the torch code sums
  ``|rows| · kept``. A kernel cannot reproduce torch's reduction order; this way it need not;
* everything between is exact: the threshold ``α = 0.75 · mean`` (one IEEE multiply, as torch's
  scalar multiply), ``−α`` by flipping the sign bit (an integer XOR, as torch negates), the two
  comparisons, the code ``plus + 2·minus``, the kept magnitude ``|x| · kept`` (1.0 or 0.0, the
  torch code's multiply: a NaN or infinite entry gives NaN either way), and the count, an
  integer sum (exact in any order);
* the scale of Eq. 4 divides with ``div_rn`` (IEEE round to nearest, as torch's tensor division
  on CUDA; Triton's ``/`` may compile to an approximate division) by the count converted to
  float32 (exact below 2^24, as torch's type promotion converts it), 0.0 where nothing was kept;
* the decode is torch's ``channel_decode``: ``((q == 1) − (q == 2)) · s`` for 2 bits,
  ``(2q − 1) · s`` for 1 bit, each factor exact, one rounding in the product.

Floating-point contraction is off at launch (``enable_fp_fusion=False``). Under ``torch.compile``
the launcher is left out of the graph (``torch.compiler.disable``): Inductor failed to compile
these kernels on the H100 (part 2 of the one-GPU check), and they need no compiling.

**Where they run.** :func:`lowbit_strategy.codecs.channel.fused_kernels` hands CUDA tensors to
this module when triton imports; everything else keeps the torch code. With
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
#: most columns a program reads at once (longer rows loop over tiles of this many)
_TILE = 2048
#: rows of at least this many columns fall back to the torch code (the count is an int32)
MAX_COLS = 2**24


def serves(t: torch.Tensor) -> bool:
    """Whether these kernels can run on ``t``'s device: CUDA with compiled kernels, or the CPU
    under the interpreter."""
    return AVAILABLE and (t.device.type == "cpu" if INTERPRETED else t.device.type == "cuda")


def _tile(c: int) -> int:
    return min(_TILE, 1 << max(0, c - 1).bit_length())


if AVAILABLE:

    @triton.jit
    def _codes_kernel(
        x_ptr, mean_ptr, codes_ptr, kept_ptr, count_ptr, c, x_rs, x_cs, k_rs, k_cs, factor,
        BITS: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        """One row: its lane codes (Eq. 5 or Eq. 7); for 2 bits also ``|x| · kept`` written over
        the row of ``|rows|`` (``kept_ptr``, its own strides) and the kept count."""
        r = tl.program_id(0).to(tl.int64)
        if BITS == 2:
            alpha = tl.load(mean_ptr + r) * factor
            neg_alpha = (alpha.to(tl.uint32, bitcast=True) ^ 0x80000000).to(tl.float32, bitcast=True)
            count = tl.zeros((TILE,), dtype=tl.int32)
        for start in range(0, c, TILE):
            j = start + tl.arange(0, TILE).to(tl.int64)
            m = j < c
            x = tl.load(x_ptr + r * x_rs + j * x_cs, mask=m, other=0.0)
            if BITS == 1:
                tl.store(codes_ptr + r * c + j, (x >= 0.0).to(tl.uint8), mask=m)
            else:
                plus = x >= alpha
                minus = x < neg_alpha
                tl.store(codes_ptr + r * c + j, plus.to(tl.uint8) + 2 * minus.to(tl.uint8), mask=m)
                kept = (plus | minus) & m
                tl.store(kept_ptr + r * k_rs + j * k_cs, tl.abs(x) * kept.to(tl.float32), mask=m)
                count += kept.to(tl.int32)
        if BITS == 2:
            tl.store(count_ptr + r, tl.sum(count, axis=0))

    @triton.jit
    def _finish_kernel(
        codes_ptr, sum_ptr, count_ptr, scales_ptr, out_ptr, c, BITS: tl.constexpr, DECODE: tl.constexpr,
        TILE: tl.constexpr,
    ):  # fmt: skip
        """One row: for 2 bits its scale (Eq. 4) from the kept sum and count; with ``DECODE``
        the row decoded, ``q · s``."""
        r = tl.program_id(0).to(tl.int64)
        if BITS == 2:
            n = tl.load(count_ptr + r)
            mean = tl.math.div_rn(tl.load(sum_ptr + r), tl.maximum(n, 1).to(tl.float32))
            s = tl.where(n > 0, mean, 0.0)
            tl.store(scales_ptr + r, s)
        else:
            s = tl.load(scales_ptr + r)
        if DECODE:
            for start in range(0, c, TILE):
                j = start + tl.arange(0, TILE).to(tl.int64)
                m = j < c
                q = tl.load(codes_ptr + r * c + j, mask=m, other=0)
                if BITS == 1:
                    signed = q.to(tl.float32) * 2.0 - 1.0
                else:
                    signed = (q == 1).to(tl.float32) - (q == 2).to(tl.float32)
                tl.store(out_ptr + r * c + j, signed * s, mask=m)


@torch.compiler.disable  # opaque to torch.compile: its graph breaks here and the kernels run as they are
def channel_encode(
    rows: torch.Tensor, mag: torch.Tensor, mean_abs: torch.Tensor, bits: int, decode: bool, factor: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`lowbit_strategy.codecs.channel.channel_encode` of float32 ``rows`` (r, c), given
    ``mag = rows.abs()`` (overwritten with the kept magnitudes for 2 bits) and its row means
    ``mean_abs`` (torch's, so torch's reduction order); ``factor`` is the threshold factor of
    Eq. 9. Returns ``(codes, scales, decoded or None)`` as the torch code: ``codes`` uint8 of
    ``r·c`` lane values, ``scales`` (r,) float32, ``decoded`` (r, c) float32."""
    r, c = rows.shape
    dev = rows.device
    codes = torch.empty(r * c, dtype=torch.uint8, device=dev)
    tile = _tile(c)
    # 1 bit: the scales are the means, and no count is kept (the kernels never touch it)
    count = torch.empty(r, dtype=torch.int32, device=dev) if bits == 2 else mean_abs
    with on_device(rows):
        _codes_kernel[(r,)](rows, mean_abs, codes, mag, count, c, *rows.stride(), *mag.stride(), factor,
                            BITS=bits, TILE=tile, **LAUNCH)  # fmt: skip
        if bits == 2:
            kept_sum = mag.sum(dim=1)  # torch's order, over the torch code's operand (module docstring)
            scales = torch.empty(r, dtype=torch.float32, device=dev)
        else:
            kept_sum = scales = mean_abs
        decoded = torch.empty(r, c, dtype=torch.float32, device=dev) if decode else None
        if bits == 2 or decode:
            _finish_kernel[(r,)](codes, kept_sum, count, scales, decoded if decode else scales, c,
                                 BITS=bits, DECODE=decode, TILE=tile, **LAUNCH)  # fmt: skip
    return codes, scales, decoded
