"""Full-precision allreduce: the uncompressed baseline behind the same interface.

What DDP does today (fp32), or with ``fp16_compress_hook``-style casting (bf16/fp16): the
sum over ranks of ``x``, sent as ``wire_dtype``. It is the reference every compressed
collective is compared with, and Lion Cub's ``fp32`` / ``bf16`` modes.
"""

from __future__ import annotations

import math

import torch

from lowbit_strategy.codecs.reduce import rank_sum
from lowbit_strategy.collectives import chain
from lowbit_strategy.collectives import group as g

WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def full_allreduce(
    x: torch.Tensor,
    group=None,
    *,
    wire_dtype: torch.dtype = torch.float32,
    check: bool = False,
    traffic=None,
) -> torch.Tensor:
    """Sum of ``x`` over ranks, sent as ``wire_dtype``; returned in ``x``'s dtype and shape.

    ``x`` itself is not modified.
    """
    return full_allreduce_start(x, group, wire_dtype=wire_dtype, check=check, traffic=traffic).wait()


def full_allreduce_start(
    x: torch.Tensor,
    group=None,
    *,
    wire_dtype: torch.dtype = torch.float32,
    check: bool = False,
    traffic=None,
) -> g.Pending:
    """:func:`full_allreduce` launched asynchronously; ``.wait()`` returns the sum."""

    def validate() -> None:
        if not x.dtype.is_floating_point:
            raise TypeError(f"full_allreduce needs a floating-point tensor, got dtype {x.dtype}")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}, got {wire_dtype}")
        if x.numel() == 0:
            raise ValueError("full_allreduce got an empty tensor")

    g.validated(validate, x, group, "full_allreduce", check, traffic)  # with check, a bad rank never raises alone
    buf = x.reshape(-1).to(wire_dtype, copy=True)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[wire_dtype]
    fut = g.all_reduce_sum_async(buf, group, f"full.allreduce.{name}", traffic)
    return g.Pending(fut, lambda: buf.to(x.dtype).view(x.shape))


def mean_allreduce_async(buf: torch.Tensor, group, op: str, traffic=None) -> torch.futures.Future:
    """DDP's own averaging of a gradient bucket, in place and bit for bit: its reducer scales
    each gradient by 1/P (a multiply, not a divide: they differ in the last bit when P is not
    a power of two) before the SUM allreduce, so fp16 does not overflow. The future resolves
    to ``buf`` and is chained (``then``) from the allreduce's own future, as DDP's own hooks
    do: a communication hook returns it, and DDP's wait on it is ordered after the data."""
    buf.mul_(1.0 / g.world_size(group))
    return chain.then(g.all_reduce_sum_async(buf, group, op, traffic), lambda _: buf)


class ExactMean:
    """:func:`mean_allreduce_async` as a :class:`~.group.Flagging` collective: DDP's exact
    mean of a flat buffer, in place, for a staged optimizer's ``fp32`` form (the fallback
    when compressing would not pay). ``.gather()`` is itself (one phase); ``.wait()``
    returns the mean after the allreduce's own wait; ``.nonfinite()`` after it: whether
    the mean holds a NaN/Inf, the same verdict on every rank (every rank holds the same
    sum, and a non-finite input on any rank makes it non-finite)."""

    def __init__(self, buf: torch.Tensor, group, op: str, traffic=None):
        self._buf = buf
        self._future = mean_allreduce_async(buf, group, op, traffic)
        self._done = False

    def gather(self) -> ExactMean:
        return self

    def wait(self) -> torch.Tensor:
        if not self._done:
            self._future.wait()  # re-raises a failed collective; orders the reads after it
            self._done = True
        return self._buf

    def nonfinite(self) -> torch.Tensor:
        if not self._done:
            raise RuntimeError("ExactMean.nonfinite() needs the collective's result: call wait() first")
        return ~torch.isfinite(self._buf).all()


def _sign_compress(v: torch.Tensor):
    """``(s·sign(v), s, sign(v), v − s·sign(v))`` with ``s = ‖v‖₂/√n`` and ``sign(0) = +1``."""
    sign = torch.where(v >= 0, 1.0, -1.0)
    if v.numel() == 0:
        scale = torch.zeros((), dtype=torch.float32, device=v.device)
    else:
        scale = torch.linalg.vector_norm(v) / math.sqrt(v.numel())
    return scale * sign, scale, sign, v - scale * sign


def compensated_allreduce_reference(
    inputs: list[torch.Tensor],
    worker_errors: list[torch.Tensor],
    server_errors: list[torch.Tensor],
    block: int | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Single-process simulation of :func:`~lowbit_strategy.collectives.compensated.compensated_allreduce`
    on ``P = len(inputs)`` ranks: the oracle its tests compare with, bit for bit.

    A plain transcription of 1-bit LAMB (arXiv:2104.06069) Algorithm 1, lines 7-11, with no
    bits, packing or process group: every rank's ``v = x + worker_error``, compressed to
    ``s·sign(v)`` with ``s = ‖v‖₂/√n`` and ``sign(0) = +1``; then, for each chunk of
    ``8·ceil(n/(8P))`` elements, the rank-ordered mean ``Σ_i (s_i/P)·sign_i`` over its real
    elements, plus that chunk's server error, compressed the same way. Float32 throughout,
    in the order the collective documents.

    ``block``: the collective's block scales, by plain loops over ranks, chunks and
    blocks: block ``b`` of chunk ``r`` is elements ``[chunk·r + b·block, min(chunk·r +
    (b+1)·block, chunk·(r+1), n))``, compressed on its own (``s = ‖v_b‖₂/√(its length)``)
    on every worker and again on the server of chunk ``r``, the mean of a block weighting
    each rank's signs by that rank's scale of the block. A block with no real element
    sends nothing. Bit-exact with the collective on CPU, where the norm of one block alone
    and the row norms the codec takes of many blocks run the same kernel.

    Arguments are not modified. Returns ``(outputs, new_worker_errors, new_server_errors)``:
    every rank's result (all equal; ``x``'s dtype and shape), and the error buffers the
    collective leaves on each rank (float32, ``n`` and ``8·ceil(n/(8P))`` elements).
    """
    if block is not None:
        return _compensated_blocks_reference(inputs, worker_errors, server_errors, block)
    p = len(inputs)
    n = inputs[0].numel()
    chunk = 8 * (-(-n // (8 * p)))

    signs, scales, new_worker_errors = [], [], []
    for x, e in zip(inputs, worker_errors):
        v = x.reshape(-1).to(torch.float32) + e.reshape(-1)
        _, scale, sign, error = _sign_compress(v)
        signs.append(sign)
        scales.append(scale)
        new_worker_errors.append(error)

    pieces, new_server_errors = [], []
    for r in range(p):
        lo, hi = min(n, r * chunk), min(n, (r + 1) * chunk)
        mean = rank_sum(torch.stack([(scales[i] / p) * signs[i][lo:hi] for i in range(p)]))  # the ranks' order
        y = mean + server_errors[r].reshape(-1)[: hi - lo]
        decoded, _, _, error = _sign_compress(y)
        pieces.append(decoded)
        server_error = torch.zeros(chunk, dtype=torch.float32, device=y.device)
        server_error[: hi - lo] = error
        new_server_errors.append(server_error)

    result = torch.cat(pieces).to(inputs[0].dtype).view(inputs[0].shape)
    return [result.clone() for _ in range(p)], new_worker_errors, new_server_errors


def _compensated_blocks_reference(inputs, worker_errors, server_errors, block: int):
    """:func:`compensated_allreduce_reference` with block scales: one loop iteration per
    rank, chunk and block, each block a separate 1-D vector."""
    p = len(inputs)
    n = inputs[0].numel()
    chunk = 8 * (-(-n // (8 * p)))
    blocks = -(-chunk // block)
    device = inputs[0].device

    def spans(r: int):
        """The real elements of every block of chunk r: (block index, lo, hi) with lo < hi."""
        for b in range(blocks):
            lo = r * chunk + b * block
            hi = min(lo + block, (r + 1) * chunk, n)
            if lo < hi:
                yield b, lo, hi

    def compress(v: torch.Tensor):
        sign = torch.where(v >= 0, 1.0, -1.0)
        scale = torch.linalg.vector_norm(v) / math.sqrt(v.numel())
        return scale * sign, scale, sign, v - scale * sign

    # worker: every rank, every chunk, every block on its own
    signs, scales, new_worker_errors = [], [], []
    for x, e in zip(inputs, worker_errors):
        v = x.reshape(-1).to(torch.float32) + e.reshape(-1)
        sign = torch.empty(n, device=device)
        error = torch.empty(n, device=device)
        block_scales = {}
        for r in range(p):
            for b, lo, hi in spans(r):
                _, block_scales[r, b], sign[lo:hi], error[lo:hi] = compress(v[lo:hi])
        signs.append(sign)
        scales.append(block_scales)
        new_worker_errors.append(error)

    # server of chunk r: per block, the rank-ordered mean weighted by each rank's block scale
    result = torch.empty(n, device=device)
    new_server_errors = []
    for r in range(p):
        server_error = torch.zeros(chunk, dtype=torch.float32, device=device)
        for b, lo, hi in spans(r):
            mean = rank_sum(torch.stack([(scales[i][r, b] / p) * signs[i][lo:hi] for i in range(p)]))
            y = mean + server_errors[r].reshape(-1)[lo - r * chunk : hi - r * chunk]
            result[lo:hi], _, _, server_error[lo - r * chunk : hi - r * chunk] = compress(y)
        new_server_errors.append(server_error)

    result = result.to(inputs[0].dtype).view(inputs[0].shape)
    return [result.clone() for _ in range(p)], new_worker_errors, new_server_errors


def turboquant_mean_reference(
    inputs, codec, two_stage: bool = False, server_errors=None, worker_errors=None, scales=None
):
    """Single-process simulation of the TurboQuant means of :mod:`.turboquant` on
    ``P = len(inputs)`` ranks: the oracle their tests compare with, bit for bit.

    Encoding and decoding are ``codec``'s own calls (the codec has its own tests); what this
    checks is the plumbing around them: chunking and padding, the rank-ordered average
    ``(d_0 + … + d_{P−1}) / P``, the error feedback and the final assembly. No packing into
    collectives, no process group.

    ``worker_errors`` (one float32 tensor of ``n`` elements per rank, or None): rank i
    sends ``u_i = x_i + worker_errors[i]``; ``scales`` (one per rank, or None): the
    ``scale=`` each rank passes (two-stage: ``1`` or ``P·nb(c)`` values, chunk-major).

    ``two_stage=False``: every rank's vector encoded whole, the P decodings averaged;
    returns the outputs (one per rank, all equal; ``x``'s shape and dtype), and with
    ``worker_errors`` also the new worker errors ``u_i − decode(encode(u_i))``:
    ``(outputs, new_worker_errors)``.
    ``two_stage=True``: each input zero-padded to ``P·c`` elements
    (``c = turboquant_server_chunk_length(n, P, codec.block)``), chunk r of every rank
    encoded on its own and averaged on "server" r, whose mean (padding zeroed) plus
    ``server_errors[r]`` (zeros when None) is encoded again; returns ``(outputs,
    new_server_errors)`` (float32, ``c`` elements, padding entries 0), plus
    ``new_worker_errors`` as a third item when ``worker_errors`` is given. Arguments are not
    modified.
    """
    from lowbit_strategy.collectives.turboquant import turboquant_server_chunk_length

    p = len(inputs)
    x0 = inputs[0]
    n = x0.numel()
    us = [
        x.reshape(-1).to(torch.float32) if worker_errors is None else x.reshape(-1).to(torch.float32) + worker_errors[i]
        for i, x in enumerate(inputs)
    ]
    scales = scales if scales is not None else [None] * p

    if not two_stage:
        decoded = [codec.decode(codec.encode(u, s)) for u, s in zip(us, scales)]
        result = _rank_mean(decoded).to(x0.dtype).view(x0.shape)
        outputs = [result.clone() for _ in range(p)]
        if worker_errors is None:
            return outputs
        return outputs, [u - d for u, d in zip(us, decoded)]

    c = turboquant_server_chunk_length(n, p, codec.block)
    pieces, new_server_errors, worker_decoded = _turboquant_two_stage_reference(us, codec, c, server_errors, scales)
    result = torch.cat(pieces)[:n].to(x0.dtype).view(x0.shape)
    outputs = [result.clone() for _ in range(p)]
    if worker_errors is None:
        return outputs, new_server_errors
    new_worker_errors = [u - torch.cat(d)[:n] for u, d in zip(us, worker_decoded)]
    return outputs, new_server_errors, new_worker_errors


def _rank_mean(decoded: list[torch.Tensor]) -> torch.Tensor:
    """``(d_0 + … + d_{P−1}) / P``, summed in the ranks' order (:func:`~lowbit_strategy.codecs.reduce.rank_sum`)."""
    return rank_sum(torch.stack(decoded)) / len(decoded)


def _turboquant_two_stage_reference(us, codec, c: int, server_errors, scales):
    """The two-stage part of :func:`turboquant_mean_reference` for the vectors ``us`` that
    ranks send: ``(decoded server chunks, new server errors, each rank's decoded worker
    chunks)``."""
    p, n, device = len(us), us[0].numel(), us[0].device
    if server_errors is None:
        server_errors = [torch.zeros(c, dtype=torch.float32, device=device) for _ in range(p)]
    padded = []
    for u in us:
        v = torch.zeros(p * c, dtype=torch.float32, device=device)
        v[:n] = u
        padded.append(v)

    def chunk_scale(s, r):
        if s is None or not isinstance(s, torch.Tensor) or s.numel() == 1:
            return s
        return s.reshape(p, -1)[r]

    worker_decoded = [
        [codec.decode(codec.encode(v[r * c : (r + 1) * c], chunk_scale(s, r))) for r in range(p)]
        for v, s in zip(padded, scales)
    ]
    pieces, new_server_errors = [], []
    for r in range(p):
        mean = _rank_mean([worker_decoded[i][r] for i in range(p)])
        real = max(0, min(c, n - r * c))
        y = torch.zeros(c, dtype=torch.float32, device=device)
        y[:real] = mean[:real] + server_errors[r].reshape(-1)[:real]
        decoded = codec.decode(codec.encode(y))
        error = torch.zeros(c, dtype=torch.float32, device=device)
        error[:real] = y[:real] - decoded[:real]
        pieces.append(decoded)
        new_server_errors.append(error)
    return pieces, new_server_errors, worker_decoded
