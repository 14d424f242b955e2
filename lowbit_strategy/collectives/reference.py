"""Single-process oracles: what each compressed collective must return, computed from every
rank's input in one process with the same codecs and the ranks' summation order. Tests
compare the collectives with them bit for bit; nothing in the training path runs them.

- :func:`compensated_allreduce_reference`: the error-compensated 1-bit allreduce (1-bit LAMB
  Algorithm 1, :mod:`.compensated`);
- :func:`turboquant_mean_reference`: TurboQuant's all-gather and two-stage means
  (:mod:`.turboquant`);
- :func:`fsdp_reduce_scatter_reference`: the quantized FSDP reduce-scatter, one hop or two
  (:mod:`.fsdp_reduce_scatter`).

The exact allreduces that lived here (``full_allreduce``, ``full_allreduce_start``,
``mean_allreduce_async``, ``ExactMean``, ``WIRE_DTYPES``) are :mod:`.exact`'s; their old path
still resolves, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import math

import torch

from lowbit_strategy import _moved
from lowbit_strategy.codecs import blockwise
from lowbit_strategy.codecs.reduce import rank_sum
from lowbit_strategy.collectives.fsdp_reduce_scatter import encode_rows, salt, sum_rows


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


def fsdp_reduce_scatter_reference(
    inputs: list[torch.Tensor],
    bits: int,
    nodes: int,
    average: bool,
    unit: int = 0,
    ranks: list[int] | None = None,
    errors: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Single-process oracle of :class:`~.fsdp_reduce_scatter.QuantizedReduceScatter`: every
    rank's output of one call, from every rank's 1-D input (the group's size =
    ``len(inputs)``; ``nodes`` > 1: two hops), with the same codec, salts (of ``unit`` and
    each rank's global rank, ``ranks[r]``, default ``r``) and sums. ``errors``: every rank's
    error-feedback buffer, updated in place."""
    w = len(inputs)
    ranks = list(range(w)) if ranks is None else ranks
    rows = [x.view(w, -1) for x in inputs]
    c = rows[0].shape[1]
    if nodes == 1:
        senders = rows
        groups = [list(range(w))]
        sent = {r: rows[r] for r in range(w)}
    else:
        per_node = w // nodes
        sent = {}
        for r in range(w):
            node, j = divmod(r, per_node)
            peers = [node * per_node + k for k in range(per_node)]
            # what each peer k sent to j: its rows of destinations m*L + j
            parts = torch.stack([rows[k].view(nodes, per_node, c)[:, j] for k in peers])  # (L, N, c)
            sent[r] = sum_rows(parts.reshape(per_node, nodes * c)).view(nodes, c)
        groups = [list(range(j, w, per_node)) for j in range(per_node)]
        senders = [sent[r] for r in range(w)]
    out: list[torch.Tensor] = [torch.empty(0)] * w
    for members in groups:
        decoded = {}
        for i, r in enumerate(members):
            error = None if errors is None else errors[r]
            codes, scales = encode_rows(senders[r], i, bits, salt(unit, ranks[r]), error)
            decoded[r] = blockwise.decode(codes, scales, bits, c)
        for i, r in enumerate(members):
            got = torch.stack([sent[r][i] if s == r else decoded[s][i] for s in members])
            total = sum_rows(got)
            out[r] = total / w if average else total
    return out


#: the exact allreduces moved to :mod:`.exact` (the training path's), still served here
__getattr__ = _moved.attribute_aliases(
    __name__,
    {
        name: f"lowbit_strategy.collectives.exact.{name}"
        for name in ("WIRE_DTYPES", "full_allreduce", "full_allreduce_start", "mean_allreduce_async", "ExactMean")
    },
)
