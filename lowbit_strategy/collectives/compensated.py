"""Error-compensated 1-bit allreduce: the compressed allreduce of 1-bit Adam and 1-bit LAMB.

"1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training with LAMB's
Convergence Speed" (Li et al., arXiv:2104.06069), Algorithm 1 lines 7-11 and Sec. 5 (the
NCCL design of 1-bit Adam's "compressed allreduce"). Every rank holds a vector ``x_i`` of
``n`` elements and two error buffers; the result, the same on every rank, is a 1-bit
estimate of the **mean** ``(1/P)·Σ_i x_i``:

1. *worker* (line 7): ``v_i = x_i + worker_error_i`` is compressed to its signs and one
   scale ``s_i = ‖v_i‖₂/√n``; ``worker_error_i ← v_i − s_i·sign(v_i)``
   (:func:`~lowbit_strategy.codecs.scaled_signs.scaled_sign_compress`);
2. *gather* (line 8, Sec. 5 step 1): all-to-all of the packed sign chunks (chunk r goes to
   rank r) and all-gather of the P worker scales;
3. *server* (line 10, Sec. 5 step 2): rank r owns chunk r. It averages the P decoded chunks
   ``(1/P)·Σ_i s_i·sign_i`` (rank order), adds its ``server_error``, and compresses again
   with a per-chunk scale ``s_r = ‖y‖₂/√(real length of the chunk)``;
   ``server_error ← y − s_r·sign(y)``;
4. *scatter* (line 11, Sec. 5 step 3): all-gather of the packed server chunks and the P
   server scales; every rank decodes the whole result, ``s_r·sign`` chunk by chunk.

**Block scales** (``block=``, a positive multiple of 8 elements): one scale per block
instead of one per vector (worker) or chunk (server). A single scale is set by the
largest entries it covers, so a layer whose momenta are much smaller than its
neighbours' is sent far too large and its error buffer carries almost all of it; the
1-bit LAMB paper (Sec. 4.3) observes this across layers. Blocks make the scale
granularity independent of how many allreduces run (bucket size). Blocks never straddle
chunks: block ``b`` of chunk ``r`` covers elements ``[8cr + b·block, min(8cr +
(b+1)·block, 8c(r+1)))``, so each chunk has ``nb = ceil(8c/block)`` blocks, and a block
scale is ``‖v_b‖₂/√(its real elements)`` (padding never counts; a block of padding only
has scale 0). The worker compresses its vector block by block (``P·nb`` scales) and sends
chunk r's ``nb`` scales to rank r with the signs: an **all-to-all** of the scales,
``(P−1)·nb·4`` bytes, where an all-gather of all ``P·nb`` would send ``(P−1)·P·nb·4`` —
P times more, for scales of chunks the receiver does not own. The server averages each
block over ranks with that rank's block scale, adds its error, compresses each block
again, and all-gathers signs and its ``nb`` block scales. ``block=None`` is exactly the
one-scale collective above.

The errors carry what the 1-bit codes could not say into the next call (error feedback),
so over many calls the sum of the results tracks the sum of the true means: for inputs
fed ``T`` times, ``Σ_t result_t = T·mean(x) − mean_i(worker_error_i) − server_error``
(telescoping), an O(1/T) error in the running mean.

Layout and padding: ``n`` is padded to P chunks of ``c = ceil(n / (8P))`` whole bytes
(:func:`~lowbit_strategy.collectives.majority.chunk_bytes`), ``8c`` elements each; rank r
owns elements ``[8cr, 8c(r+1))``. Padding is never part of a norm, its bits are 0 and are
dropped when decoding, and its error entries stay 0. With ``n < P`` (or any ``n`` not
filling the last chunks) a rank may own padding only: its server scale is 0. The
``server_error`` of every rank has ``server_chunk_length(n, P) = 8c`` elements.

Zeros: ``sign(0) = +1`` (``+0.0`` and ``-0.0``), as in DeepSpeed; the error feedback
returns the ``±s`` it adds to a zero on the next call, so the fixed choice leaves no bias.

Dtypes: ``x`` may be float16, bfloat16, float32 or float64. All arithmetic is float32
(16-bit inputs convert exactly, float64 is rounded to float32), both error buffers are
float32 and the scales travel as float32. The result is float32 rounded to the dtype of
``out`` (default: ``x``'s dtype); for a 16-bit ``x``, pass a float32 ``out`` to get the
exact values whose rounding error the error feedback has accounted for.

Bytes per rank (sent = received): ``(P−1)·c`` for each of the two sign phases and
``(P−1)·4·nb`` for each of the two scale phases (4 bytes per block per peer per phase;
``nb = 1`` without blocks), ``2(P−1)(c + 4·nb)`` in all, about 1/32 of a float32 ring
allreduce (``2(P−1)·4n/P``) plus ``1/block`` of it for the scales. With ``P = 1`` nothing
is sent, and the same arithmetic runs (a 1-rank result equals the P = 1 simulation).

State: ``worker_error`` and ``server_error`` are this rank's own (save them per rank);
``server_error`` describes chunk r of the vector, so it only means something for the
same ``n`` and P. Start both as zeros (:func:`compensated_error_buffers`). Their sizes
do not depend on ``block``; every rank must pass the same ``block`` (``check=True``
compares lengths, not ``block``).

Non-finite input gives non-finite scales, results and errors on every rank (with
blocks: in the blocks holding it); check the input first (1-bit Adam/LAMB skip an
overflowed step before compressing).
"""

from __future__ import annotations

import torch

from lowbit_strategy.codecs.scaled_signs import (
    check_error_buffer,
    check_input,
    check_scale_block,
    scaled_sign_compress,
    scaled_sign_decode,
    scaled_sign_mean,
)
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.majority import chunk_bytes
from lowbit_strategy.validation import check_int

_WHAT = "compensated_allreduce"


def server_chunk_length(n: int, world_size: int) -> int:
    """Elements of each rank's chunk, padding included: the length of ``server_error``.

    ``8·ceil(n / (8·world_size))``: P chunks of whole bytes of sign bits.
    """
    for name, value in (("n", n), ("world_size", world_size)):
        check_int("server_chunk_length", name, value, 1)
    return 8 * chunk_bytes(n, world_size)


def compensated_error_buffers(x: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero ``(worker_error, server_error)`` for vectors like ``x`` on this rank of ``group``:
    float32 on ``x``'s device, ``x.numel()`` and :func:`server_chunk_length` elements."""
    check_input(x, "x", "compensated_error_buffers")
    n, p = x.numel(), g.world_size(group)
    return (
        torch.zeros(n, dtype=torch.float32, device=x.device),
        torch.zeros(server_chunk_length(n, p), dtype=torch.float32, device=x.device),
    )


def compensated_allreduce(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group=None,
    *,
    out: torch.Tensor | None = None,
    check: bool = False,
    traffic=None,
    block: int | None = None,
) -> torch.Tensor:
    """The error-compensated 1-bit estimate of the rank mean of ``x`` (module docstring).

    ``x``: this rank's vector, any shape (not modified). ``worker_error``: float32,
    contiguous, ``x.numel()`` elements; ``server_error``: float32, contiguous,
    ``server_chunk_length(x.numel(), P)`` elements; both updated in place. ``out``: an
    optional floating tensor of ``x.numel()`` elements to write the result into (may be
    ``x`` itself). Returns the result with ``x``'s shape, in ``out``'s dtype (default
    ``x``'s), bit-identical on every rank. ``check=True`` adds one small collective that
    makes every rank raise when any rank passed a different length or invalid arguments
    (without it a rank raising alone leaves its peers waiting until the group's timeout).
    ``block``: elements per scale (a positive multiple of 8, the same on every rank), or
    None for one scale per vector and per chunk (module docstring, "Block scales").
    """
    return compensated_allreduce_start(
        x, worker_error, server_error, group, out=out, check=check, traffic=traffic, block=block
    ).wait()


class CompensatedAllreduce(g.TwoPhase):
    """A :func:`compensated_allreduce` in flight (:func:`compensated_allreduce_start`).

    The second phase depends on the first's data, so the caller launches it:
    :meth:`gather` waits for the all-to-all and the scale gather, runs the server step on
    this rank's chunk (updating ``server_error``) and starts the two all-gathers (call it
    on every rank in the same order as the starts); ``.gather().wait()`` — or
    :meth:`wait` — returns the result.

    :attr:`worker_scales` (after :meth:`gather`) and :attr:`server_scales` (after the
    result is waited for) hold the float32 scales of each phase. Without blocks: the P
    worker scales and the P server scales, identical on every rank. With ``block``:
    ``worker_scales`` is ``(P, nb)``, row i = rank i's block scales of *this* rank's chunk
    (what the all-to-all delivered: it differs from rank to rank), and ``server_scales`` is
    ``(P, nb)``, row r = chunk r's server block scales, identical on every rank.
    A NaN or inf in any rank's input makes its worker scale non-finite, and with it every
    server scale of a chunk with real elements (with blocks: the scale of the element's
    block, and the server scale of that block): ``torch.isfinite(server_scales).all()`` is
    the same verdict on every rank, an agreement on "skip this step" with no extra
    collective (the errors have moved by then: pass copies if a skipped step must not move
    them).
    """

    def __init__(
        self,
        x,
        server_error,
        out,
        group,
        p,
        rank,
        c,
        received,
        scales,
        futures,
        traffic,
        block=None,
        keep=False,
        server_out=None,
    ):
        self._shape, self._n, self._dtype, self._block = x.shape, x.numel(), x.dtype, block
        self._out, self._group, self._keep, self._server_out = out, group, keep, server_out
        #: the server error buffer: the one passed, updated in place; with
        #: ``keep_server_error=True`` a new buffer after :meth:`gather` (the one passed is left as it was)
        self.server_error = server_error
        self._p, self._rank, self._c = p, rank, c
        self._received, self._scales, self._futures, self._traffic = received, scales, futures, traffic
        self.worker_scales: torch.Tensor | None = None
        self.server_scales: torch.Tensor | None = None

    def nonfinite(self) -> torch.Tensor:
        """After the wait: whether any rank's input was non-finite (it made the server scales so)."""
        return g.nonfinite(self.server_scales, "CompensatedAllreduce")

    def _second_phase(self) -> g.Pending:
        """Finish phase one, run the server step, start phase two (:meth:`gather` runs it once)."""
        for f in self._futures:
            f.wait()  # re-raises a failed collective
        p, c, rank, n, block = self._p, self._c, self._rank, self._n, self._block
        self.worker_scales = self._scales
        # server (Algorithm 1, line 10): mean of the P decoded chunks, + error, compress again
        mean = scaled_sign_mean(self._received.view(p, c), self._scales, block, out=self._server_out)
        real = max(0, min(8 * c, n - 8 * c * rank))  # elements of this chunk that are not padding
        old = self.server_error.view(-1)
        if self._keep:  # mean + error = error + mean: the new error is computed into `mean`
            vector, error = old[:real], mean[:real]
            mean[real:].zero_()  # padding's error entries stay 0
            self.server_error = mean
        else:
            vector, error = mean[:real], old[:real]
        bits, scale = scaled_sign_compress(
            vector,
            error,
            nbytes=c,
            block=block,
            chunk=None if block is None else 8 * c,  # (1, nb): padding blocks get 0
        )
        del mean, vector, error
        every_bits = torch.empty(p * c, dtype=torch.uint8, device=bits.device)
        every_scales = torch.empty(p, scale.numel(), dtype=torch.float32, device=bits.device)
        f_bits = g.all_gather_async(every_bits, bits, self._group, "compensated.server_signs", self._traffic)
        f_scales = g.all_gather_async(
            every_scales.view(-1), scale.reshape(-1), self._group, "compensated.server_scales", self._traffic
        )
        shape, out = self._shape, self._out
        dtype = self._dtype if out is None else out.dtype

        def finish() -> torch.Tensor:  # after both collectives' own wait() (Pending)
            self.server_scales = every_scales if block is not None else every_scales.view(p)
            into = None if out is None or not out.is_contiguous() else out.view(-1)
            result = scaled_sign_decode(every_bits.view(p, c), every_scales, n, dtype, block, out=into)
            if out is None:
                return result.view(shape)
            if into is None:
                out.view(-1).copy_(result)
            return out.view(shape)

        pending = g.Pending([f_bits, f_scales], finish)
        self._futures = self._received = self._scales = None
        return pending


def _validate(x, worker_error, server_error, out, p: int, block) -> None:
    check_scale_block(block, _WHAT)
    check_input(x, "x", _WHAT)
    n = x.numel()
    if n == 0:
        raise ValueError(f"{_WHAT}: x is empty")
    check_error_buffer(worker_error, n, x.device, "worker_error", _WHAT, "x.numel()")
    check_error_buffer(
        server_error,
        server_chunk_length(n, p),
        x.device,
        "server_error",
        _WHAT,
        f"server_chunk_length(x.numel(), P={p})",
    )
    if out is not None:
        check_input(out, "out", _WHAT)
        if out.numel() != n or out.device != x.device:
            raise ValueError(
                f"{_WHAT}: out must hold x.numel() = {n} elements on {x.device}, got {out.numel()} on {out.device}"
            )
        if not out.is_contiguous():
            raise ValueError(f"{_WHAT}: out must be contiguous")


def compensated_allreduce_start(
    x: torch.Tensor,
    worker_error: torch.Tensor,
    server_error: torch.Tensor,
    group=None,
    *,
    out: torch.Tensor | None = None,
    check: bool = False,
    traffic=None,
    block: int | None = None,
    keep_server_error: bool = False,
    server_out: torch.Tensor | None = None,
) -> CompensatedAllreduce:
    """Start :func:`compensated_allreduce`: compress this rank's ``x`` (``worker_error`` is
    updated before this returns, ``x`` is no longer needed) and launch the all-to-all of
    the sign chunks and the all-gather of the worker scales, asynchronously.

    ``server_error`` is updated, and the second phase launched, by
    :meth:`CompensatedAllreduce.gather` (or ``.wait()``); ``out`` is written by the wait.
    Arguments as in :func:`compensated_allreduce`. Every rank must start (and gather) its
    allreduces in the same order.

    ``keep_server_error=True``: ``server_error`` is only read; the updated one is a new
    buffer, :attr:`CompensatedAllreduce.server_error` after the gather (the same floats):
    ``server_out`` when given (float32, contiguous, ``server_error``'s length; a buffer kept
    across calls).
    For a caller that must keep the old one until it knows the step is applied; for the
    worker the same is had by passing the committed error as ``x`` and a buffer holding
    ``x`` as ``worker_error`` (``x + e = e + x``, float32 to float32).
    """
    p = g.world_size(group)
    g.validated(lambda: _validate(x, worker_error, server_error, out, p, block), x, group, _WHAT, check, traffic)
    rank = g.rank(group)
    c = chunk_bytes(x.numel(), p)
    # worker (Algorithm 1, line 7), padded to P chunks of c bytes
    bits, scale = scaled_sign_compress(
        x, worker_error, nbytes=p * c, block=block, chunk=None if block is None else 8 * c
    )
    received = torch.empty_like(bits)
    f_signs = g.all_to_all_async(received, bits, group, "compensated.signs", traffic)
    if block is None:  # one scale: every rank needs it
        scales = torch.empty(p, dtype=torch.float32, device=bits.device)
        f_scales = g.all_gather_async(scales, scale.reshape(1), group, "compensated.scales", traffic)
    else:  # (P, nb) block scales: rank r needs chunk r's row only, so an all-to-all
        scales = torch.empty_like(scale)
        f_scales = g.all_to_all_async(scales.view(-1), scale.view(-1), group, "compensated.scales", traffic)
    futures = (f_signs, f_scales)
    if server_out is not None and (not keep_server_error or server_out.numel() != 8 * c):
        raise ValueError(f"{_WHAT}: server_out needs keep_server_error=True and {8 * c} elements")
    return CompensatedAllreduce(
        x,
        server_error,
        out,
        group,
        p,
        rank,
        c,
        received,
        scales,
        futures,
        traffic,
        block,
        keep_server_error,
        server_out,
    )
