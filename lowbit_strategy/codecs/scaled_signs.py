"""Error-compensated 1-bit codes with one scale (or one per block): the compressor of 1-bit Adam / 1-bit LAMB.

"1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training with LAMB's
Convergence Speed" (Li et al., arXiv:2104.06069), Algorithm 1, lines 7 and 10, compresses
a vector ``v`` (the local momentum plus the previous compression error) into its signs and
one scale, and keeps what the code could not say as the next step's error:

    C[v]   = s · sign(v),        s = ‖v‖₂ / √n   (n = number of real elements)
    error' = v − C[v]

``s = ‖v‖₂/√n`` makes ``‖C[v]‖₂ = ‖v‖₂``. The same compressor runs twice in the compressed
allreduce (:mod:`lowbit_strategy.collectives.compensated`): on every worker over its whole
vector, and on every server over the chunk it owns. These functions are the pure parts:
no process group, no host synchronization (the scale stays a device tensor).

**Block scales** (``block=``): the same compressor on every block of ``block`` consecutive
elements, each with its own ``s_b = ‖v_b‖₂/√n_b`` (``n_b`` = the real elements of the
block; the last block may be partial). One scale for a whole vector is dominated by its
largest entries: a layer whose momenta are 1000x smaller than its neighbour's is sent as
``±s`` of the neighbour's size, and its error buffer has to carry almost all of it. The
1-bit LAMB paper (arXiv:2104.06069, Sec. 4.3) makes the same observation about layers of
different magnitudes sharing one scale; per-block scales make the scale granularity a
setting of the codec rather than a side effect of how many vectors are sent. ``block``
is a positive multiple of 8, so every byte of sign bits belongs to one block. With
``chunk=``, blocks restart at every ``chunk`` elements (the collective's layout: no block
straddles two ranks' chunks). ``block=None`` is the one-scale code, unchanged.

Rules:

* **Zeros.** ``sign(v) = +1`` for ``v >= 0``, both ``+0.0`` and ``-0.0`` (DeepSpeed's
  compressed allreduce maps 0 to +1 too). The fixed choice is harmless here, unlike in a
  plain sign vote (:mod:`.signs`): a zero sent as ``+s`` leaves ``-s`` in the error, which
  the next step adds back, so the bias does not accumulate. An all-zero ``v`` gets
  ``s = 0`` and keeps a zero error.
* **Arithmetic.** Everything is float32 whatever the input's dtype: ``v = float32(x) +
  error`` (16-bit inputs convert exactly; float64 is rounded to float32 first), the error
  buffer is float32, ``s`` is ``torch.linalg.vector_norm(v) / math.sqrt(n)`` in float32
  (per block: the row norms of a view of the blocks, which on CPU is the same kernel, and
  the same floats, as the norm of each block alone), and ``error' = v − s·sign(v)`` is
  rounded once per element (``s·sign`` is exact).
* **Bits.** Bit 1 means +1, 0 means −1, laid out like ``bits.pack(codes, 1)``: element
  ``i`` at bit ``i % 8`` of byte ``i // 8``. Padding bits (past ``n``) are 0.
* **Range.** The norm squares in float32 (as DeepSpeed's does), which is fast and exact to
  float32 rounding while the squares stay in float32's range: elements below ~1e-19 add
  nothing to it (a vector of only such values gets scale 0, and its error keeps carrying
  them, never a NaN), and ``‖v‖₂`` above ~1.8e19 overflows to an infinite scale. Momenta
  and gradients live far inside this range.
* **Non-finite input** gives a NaN/inf scale, and with it a non-finite error buffer; check
  the input before compressing (an optimizer skipping an overflowed step must skip this too).
"""

from __future__ import annotations

import math

import torch

from lowbit_strategy.codecs import compiled
from lowbit_strategy.codecs.bits import pack_bools, pack_bytes_into_lanes
from lowbit_strategy.codecs.scaled_signs_decode import check_scale_block, scaled_sign_decode, scaled_sign_mean
from lowbit_strategy.codecs.signs import compare_bytes, fused_kernels
from lowbit_strategy.codecs.streaming import SLICE, sliced, slices
from lowbit_strategy.validation import is_int

__all__ = [
    "INPUT_DTYPES",
    "check_error_buffer",
    "check_input",
    "check_scale_block",
    "scaled_sign_compress",
    "scaled_sign_decode",
    "scaled_sign_mean",
]

#: dtypes accepted as input; the arithmetic and the error buffers are float32 for all.
INPUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_input(x, name: str, what: str) -> None:
    """``TypeError`` unless ``x`` is a tensor of one of :data:`INPUT_DTYPES`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{what}: {name} must be a floating-point tensor ({', '.join(map(str, INPUT_DTYPES))}), got dtype {x.dtype}"
        )


def check_error_buffer(buf, numel: int, device: torch.device, name: str, what: str, sized_by: str) -> None:
    """``TypeError``/``ValueError`` naming ``name`` unless ``buf`` is a contiguous float32
    tensor of ``numel`` elements on ``device`` (``sized_by`` says where ``numel`` comes from)."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != torch.float32:
        raise TypeError(
            f"{what}: {name} must be float32 (the error feedback is kept in float32 whatever "
            f"the input's dtype), got dtype {buf.dtype}"
        )
    if buf.numel() != numel:
        raise ValueError(
            f"{what}: {name} must hold {sized_by} = {numel} elements, got {buf.numel()} (shape {tuple(buf.shape)})"
        )
    if buf.device != device:
        raise ValueError(f"{what}: {name} is on {buf.device}, the input on {device}; keep them on one device")
    if not buf.is_contiguous():
        raise ValueError(f"{what}: {name} must be contiguous (it is updated in place)")


def _block_pieces(n: int, length: int, block: int):
    """The real elements of ``rows`` rows of ``length`` elements, cut into blocks that
    restart at every row, as at most four strided ``(rows, blocks, block length)`` pieces:
    ``(offset, size, stride, rows slice, blocks slice)``. Full rows' whole blocks, full
    rows' partial last block, the partial row's whole blocks, its partial last block. A
    constant number of pieces whatever the number of blocks: no Python loop over blocks."""
    full_rows, rest = divmod(n, length)
    whole, tail = divmod(length, block)
    rest_whole, rest_tail = divmod(rest, block)
    pieces = [
        (0, (full_rows, whole, block), (length, block, 1), slice(0, full_rows), slice(0, whole)),
        (whole * block, (full_rows, 1, tail), (length, tail, 1), slice(0, full_rows), slice(whole, whole + 1)),
        (
            full_rows * length,
            (1, rest_whole, block),
            (length, block, 1),
            slice(full_rows, full_rows + 1),
            slice(0, rest_whole),
        ),
        (
            full_rows * length + rest_whole * block,
            (1, 1, rest_tail),
            (length, rest_tail, 1),
            slice(full_rows, full_rows + 1),
            slice(rest_whole, rest_whole + 1),
        ),
    ]
    return [piece for piece in pieces if math.prod(piece[1])]


def _piece(t: torch.Tensor, offset: int, size, stride) -> torch.Tensor:
    """A strided view of 1-D contiguous ``t`` starting ``offset`` elements into it."""
    return t.as_strided(size, stride, t.storage_offset() + offset)


@torch.no_grad()
def scaled_sign_compress(
    x: torch.Tensor,
    error: torch.Tensor,
    *,
    nbytes: int | None = None,
    block: int | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compress ``v = x + error`` to sign bits and scales; ``error`` becomes ``v − C[v]``.

    1-bit LAMB (arXiv:2104.06069) Algorithm 1, line 7 (worker) and line 10 (server), with
    ``C[v] = ‖v‖₂/√n · sign(v)`` as in the module docstring (zeros count as +1).

    ``x``: any shape, one of :data:`INPUT_DTYPES`, not modified. ``error``: float32,
    contiguous, ``x.numel()`` elements, updated in place (it holds ``v`` on the way, so no
    float32 copy of the input is made). ``nbytes``: length of the returned bit buffer, at
    least ``ceil(n / 8)`` (the default); the bits past ``n`` are 0 — the collective uses it
    to pad to whole chunks.

    ``block`` (a positive multiple of 8, or None): elements per scale. None: one scale for
    the whole vector. Otherwise block ``b`` covers elements ``[b·block, min((b+1)·block,
    n))`` and gets ``s_b = ‖v_b‖₂/√(its real elements)``. ``chunk`` (only with ``block``; a
    positive multiple of 8 dividing ``8·nbytes``): blocks restart at every ``chunk``
    elements — block ``b`` of chunk ``r`` covers ``[chunk·r + b·block, min(chunk·r +
    (b+1)·block, chunk·(r+1), n))`` — and every chunk of the ``8·nbytes`` padded elements
    has ``ceil(chunk/block)`` scales, 0 for blocks of padding only.

    Returns ``(bits, scales)``: ``nbytes`` uint8 bytes and float32 scales on ``x``'s
    device: a 0-d tensor (``block=None``), ``ceil(n/block)`` values (``block``), or
    ``(8·nbytes/chunk, ceil(chunk/block))`` (``block`` and ``chunk``). ``n = 0`` is allowed
    (a server chunk of padding only): scales 0, all bits 0.
    """
    nbytes = _check_compress(x, error, nbytes, block, chunk)
    n = x.numel()
    v = error.view(-1)
    v.add_(x.reshape(-1).float() if x.dtype == torch.float64 else x.reshape(-1))  # v = float32(x) + error
    scale, grid, pieces = _compress_scales(v, n, nbytes, block, chunk)
    fused = fused_kernels(v)
    if fused is not None:  # CUDA: signs, packing and the new error in one kernel (the same bits)
        return fused.compress(v, grid, nbytes, block, chunk), scale
    if block is None and compiled.compiled_enabled():  # opt-in: the same bits, compiled (compiled.py)
        bits = compiled.signs_and_error(v, scale, nbytes)
        if bits is not None:
            return bits, scale
    if sliced(v):
        if block is None:
            return _signs_and_error_sliced(v, nbytes, scale), scale
        return _signs_and_error_sliced_blocks(v, nbytes, grid, block, chunk or n), scale
    codes = torch.empty(8 * nbytes, dtype=torch.int8, device=x.device)
    codes[n:] = 0
    compare_bytes(torch.ge, v, 0, out=codes[:n])  # 1 for v >= 0 (zeros too), else 0
    sign = torch.mul(codes[:n], 2).sub_(1)  # ±1 as int8: a quarter of a float32 sign vector
    if block is None:
        v.addcmul_(sign, scale, value=-1)  # error = v − s·sign(v): s·sign is exact, one rounding
    else:
        for offset, size, stride, rs, bs in pieces:  # the same, each block with its own scale
            _piece(v, offset, size, stride).addcmul_(_piece(sign, offset, size, stride), grid[rs, bs, None], value=-1)
    del sign
    return pack_bytes_into_lanes(codes.view(torch.uint8), 1, owned=True), scale


def _signs_and_error_sliced(v: torch.Tensor, nbytes: int, scale: torch.Tensor) -> torch.Tensor:
    """The packed sign bits of ``v`` (``nbytes``, zero-padded) and ``v`` ← ``v − s·sign(v)``,
    slice by slice (:mod:`.streaming`): the operations of the whole-vector form on each
    slice, the votes and ±1 signs in reused buffers, the votes packed straight into the
    output (:func:`.bits.pack_bools`; no ``8·nbytes``-byte code tensor)."""
    n = v.numel()
    out = torch.zeros(nbytes, dtype=torch.uint8, device=v.device)
    votes = torch.empty(min(SLICE, n), dtype=torch.bool, device=v.device)  # SLICE: a multiple of 8
    signs = torch.empty(votes.numel(), dtype=torch.int8, device=v.device)
    for start, stop in slices(n):
        part = v[start:stop]
        positive = votes[: stop - start]
        torch.ge(part, 0, out=positive.view(torch.int8))  # v >= 0, zeros too (int8 out: see compare_bytes)
        # ±1 as int8 and the same addcmul_ as the whole-vector form (a float where() of ±s
        # measured 10x slower); error = v − s·sign(v): s·sign is exact, one rounding
        sign = torch.mul(positive.view(torch.int8), 2, out=signs[: stop - start]).sub_(1)
        part.addcmul_(sign, scale, value=-1)
        pack_bools(positive, out[start // 8 : -(-stop // 8)])
    return out


def _signs_and_error_sliced_blocks(
    v: torch.Tensor, nbytes: int, grid: torch.Tensor, block: int, length: int
) -> torch.Tensor:
    """:func:`_signs_and_error_sliced` with a scale per block: rows of ``length`` elements
    (the collective's chunks; blocks restart at each), each cut into slices of whole blocks,
    and in each slice ``v − s_b·sign(v)`` by one ``addcmul_`` over its whole blocks (a
    ``(blocks, block)`` view against ``grid[row, blocks, None]``) and one for a partial last
    block: the same elementwise operation as the whole-vector form, so the same bits. Row
    starts (``length``) and slices are multiples of 8 elements: whole bytes of bits."""
    n = v.numel()
    out = torch.zeros(nbytes, dtype=torch.uint8, device=v.device)
    size = max(1, SLICE // block) * block
    votes = torch.empty(min(size, n), dtype=torch.bool, device=v.device)
    signs = torch.empty(votes.numel(), dtype=torch.float32, device=v.device)  # ±1.0: addcmul_ casts no int8
    for row, row_start in enumerate(range(0, n, length)):
        real = min(length, n - row_start)
        for start, stop in slices(real, size):
            part, m = v[row_start + start : row_start + stop], stop - start
            positive = votes[:m]
            torch.ge(part, 0, out=positive.view(torch.int8))  # v >= 0, zeros too
            sign = torch.mul(positive.view(torch.int8), 2, out=signs[:m]).sub_(1)  # exact ±1
            first, whole = start // block, m // block
            if whole:
                part[: whole * block].view(whole, block).addcmul_(
                    sign[: whole * block].view(whole, block), grid[row, first : first + whole, None], value=-1
                )
            if m > whole * block:  # the row's partial last block
                part[whole * block :].addcmul_(sign[whole * block : m], grid[row, first + whole], value=-1)
            at = row_start + start
            pack_bools(positive, out[at // 8 : -(-(at + m) // 8)])
    return out


def _check_compress(x, error, nbytes: int | None, block: int | None, chunk: int | None) -> int:
    """The arguments of :func:`scaled_sign_compress`, checked; returns ``nbytes`` (its default filled in)."""
    what = "scaled_sign_compress"
    check_input(x, "x", what)
    n = x.numel()
    check_error_buffer(error, n, x.device, "error", what, "x.numel()")
    need = -(-n // 8)
    if nbytes is None:
        nbytes = need
    elif not is_int(nbytes, need):
        raise ValueError(f"{what}: nbytes must be an int of at least ceil(n / 8) = {need}, got {nbytes!r}")
    check_scale_block(block, what)
    if chunk is not None:
        if block is None:
            raise ValueError(f"{what}: chunk needs block (blocks restart at every chunk)")
        if not is_int(chunk, 8) or chunk % 8 or (8 * nbytes) % chunk:
            raise ValueError(
                f"{what}: chunk must be a positive multiple of 8 dividing 8 * nbytes = {8 * nbytes}, got {chunk!r}"
            )
    return nbytes


def _compress_scales(v: torch.Tensor, n: int, nbytes: int, block: int | None, chunk: int | None):
    """``(scales, grid, pieces)`` of :func:`scaled_sign_compress` for ``v`` (its ``n`` real
    elements): the scales as returned; with ``block``, the same scales as a ``(rows,
    blocks per row)`` grid and the block pieces (:func:`_block_pieces`) whose scale is
    ``grid[rs, bs]``."""
    if block is None:
        if n:
            scale = torch.linalg.vector_norm(v) / math.sqrt(n)
        else:
            scale = torch.zeros((), dtype=torch.float32, device=v.device)
        return scale, scale, []
    length = chunk if chunk is not None else max(n, 1)
    rows = 8 * nbytes // chunk if chunk is not None else 1
    per_row = -(-length // block) if n or chunk is not None else 0
    grid = torch.zeros(rows, per_row, dtype=torch.float32, device=v.device)  # blocks of padding: 0
    pieces = _block_pieces(n, length, block) if n else []
    for offset, size, stride, rs, bs in pieces:
        grid[rs, bs] = torch.linalg.vector_norm(_piece(v, offset, size, stride), dim=-1) / math.sqrt(size[2])
    return (grid if chunk is not None else grid.view(-1)), grid, pieces
