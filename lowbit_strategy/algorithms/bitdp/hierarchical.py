"""BitDP across nodes: the hierarchical form (:mod:`lowbit_strategy.collectives.hierarchy`).

The node is the worker. For each DDP bucket:

1. the bucket is replaced by its exact mean over the node's L ranks (DDP's arithmetic);
2. local rank j takes rows ``[⌊j·R/L⌋, ⌊(j+1)·R/L⌋)`` of every quantized matrix (channel
   rows: a row keeps its scale, so each row's codes are the flat algorithm's), and shard j
   of the bucket's full-precision runs, and runs BitDP on them over its cross-node group
   (local rank j of every node, N ranks): the all-gather or the two-stage form, the same
   one for every shard (``form_of``, planned for N), with the non-finite flag beside the
   scales as in the flat hook;
3. the node all-gathers the L results (padded to the longest) and every rank writes each
   one back where it came from.

So every row's mean is the flat algorithm's over N workers that each hold their node's mean
gradient, and each node sends every row once across nodes. During the warm-up every
gradient goes the full-precision way (1-2 above with no quantized rows): DDP's mean over
nodes of the node means. On a single node the node mean is the result (DDP's, bit for bit):
nothing crosses a network, nothing is compressed or gathered. The
hook waits for its cross-node collectives before it starts the node's all-gather (a second
collective, launched in hook order on every rank, never from a callback): on NCCL a stream
wait, on gloo the transfer itself.

Error-feedback residuals keep the parameter's shape; this rank fills only its rows of them.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook inspects the hook's
# annotations and accepts only the real objects dist.GradBucket / Future[Tensor], not strings.
import math

import torch
import torch.distributed as dist

from lowbit_strategy.algorithms.bitdp.hook import BucketSplit
from lowbit_strategy.codecs.channel import channel_encode_many
from lowbit_strategy.codecs.reduce import nonfinite_flag
from lowbit_strategy.collectives import chain
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.exact import mean_allreduce_async, wire_dtype_of
from lowbit_strategy.collectives.gathered import PayloadLayout, gathered_mean_async, matrix_shape, pack_payload
from lowbit_strategy.collectives.gathered_two_stage import gathered_two_stage_start

__all__ = ["across_nodes", "hierarchical_hook", "row_range"]


def row_range(rows: int, ranks_per_node: int, local_rank: int) -> tuple[int, int]:
    """The channel rows of an ``rows``-row matrix local rank ``local_rank`` sends across nodes."""
    return local_rank * rows // ranks_per_node, (local_rank + 1) * rows // ranks_per_node


def _pieces(rows: list[torch.Tensor], per_node: int, j: int) -> list[tuple[int, int, int]]:
    """``(matrix, first row, end row)`` of local rank ``j``, matrices with no rows left out."""
    return [(k, a, b) for k, r in enumerate(rows) for a, b in [row_range(r.shape[0], per_node, j)] if b > a]


def _encode(state, plan: BucketSplit, rows, pieces):
    """Codes, scales and new residuals (full parameter shape, this rank's rows changed) of
    this rank's rows, as the flat hook's ``_encode`` does for whole matrices."""
    ms, olds = [], []
    for k, a, b in pieces:
        key = plan.quantized[k][2]
        m = rows[k][a:b].float()
        old = state.residuals.get(key) if state.error_feedback else None
        if old is not None:
            m = m + (old.t() if key in plan.transposed else old)[a:b].to(m.device)
        ms.append(m)
        olds.append(old)
    enc = channel_encode_many(ms, state.bits, decode=state.error_feedback, validate=False)  # equal widths at once
    residuals = {}
    for (k, a, b), m, old, (_, _, d) in zip(pieces, ms, olds, enc):
        if d is not None:
            key = plan.quantized[k][2]
            full = rows[k].new_zeros(rows[k].shape, dtype=torch.float32) if old is None else old.to(m.device).clone()
            if old is None and key in plan.transposed:
                full = full.t().contiguous()  # kept in the parameter's own layout
            (full.t() if key in plan.transposed else full)[a:b] = m - d.view(m.shape)
            residuals[key] = full
    return [c for c, _, _ in enc], [s for _, s, _ in enc], residuals


def _full_runs(buf: torch.Tensor, runs) -> list[torch.Tensor]:
    return [buf[o : o + n] for o, n in runs]


def hierarchical_hook(sync, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook of BitDP across nodes (module docstring); ``sync`` is the
    :class:`~.algorithm.BitDPSync`, whose ``state.process_group`` is the cross-node group."""
    sync.topology.node_mean_(bucket.buffer(), sync.node_traffic)
    return across_nodes(sync, bucket)


def across_nodes(sync, bucket) -> torch.futures.Future[torch.Tensor]:
    """Steps 2-3 of the module docstring on a bucket that holds the node's mean already:
    :func:`hierarchical_hook` after its node mean, and the staged optimizers' coded warm-up
    (:mod:`lowbit_strategy.algorithms.staged.warmup_codes`), whose DDP adapter averaged the
    node itself. ``bucket``: what of ``dist.GradBucket`` :meth:`.BitDPState.plan` reads."""
    state, topo, traffic = sync.state, sync.topology, sync.state.traffic
    buf = bucket.buffer()
    plan = state.plan(bucket)
    warmup = state.iter < state.start_iter
    state.maybe_increase_iter(bucket)
    per_node, j, inter = topo.ranks_per_node, topo.local_rank, topo.inter
    if g.world_size(inter) == 1:  # one node: the node mean is DDP's mean, every rank holds it whole
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buf)  # (node_mean_'s wait() ordered the compute stream after it on NCCL)
        return done
    mats = [buf[o : o + math.prod(s)].view(s) for o, s, _ in plan.quantized]
    rows = [m.t() if key in plan.transposed else m for (_, _, key), m in zip(plan.quantized, mats)]
    # the warm-up sends every gradient the exact way (a mean over nodes of the node means)
    exact = warmup
    runs = ((0, buf.numel()),) if exact else plan.full
    if exact:
        rows = []
    nfull = sum(n for _, n in runs)
    size = -(-nfull // per_node)
    # every local rank's rows and full-precision slice: its result's layout in the gather
    pieces = [_pieces(rows, per_node, i) for i in range(per_node)]
    slices = [(min(nfull, i * size), min(nfull, (i + 1) * size)) for i in range(per_node)]
    lengths = [
        sum((b - a) * rows[k][0].numel() for k, a, b in pieces[i]) + hi - lo for i, (lo, hi) in enumerate(slices)
    ]
    mine = pieces[j]
    parts: list[torch.Tensor] = []
    f_q = residuals = None
    if mine:
        nonfinite = nonfinite_flag(buf)
        sub = [rows[k][a:b] for k, a, b in mine]
        sub_plan = BucketSplit(tuple(plan.quantized[k] for k, _, _ in mine), (), plan.param_ids, plan.transposed)
        codes, scales, residuals = _encode(state, plan, rows, mine)
        layout = PayloadLayout.of([matrix_shape(m) for m in sub], state.bits)
        kw = dict(chunk_rows=state.chunk_rows, out=None, traffic=traffic, flag=nonfinite)
        if state.form_of() == "two_stage":
            err = state.server_error(sub_plan, layout, buf.device)
            f_q = gathered_two_stage_start(codes, scales, layout, err, inter, **kw).gather()
        else:
            words, scl = pack_payload(codes, scales, layout)
            f_q = gathered_mean_async(words, scl, layout, inter, reduction=state.reduction, **kw)
    lo, hi = slices[j]
    fp = None
    if hi > lo:
        fp = torch.cat(_full_runs(buf, runs))[lo:hi]
        # DDP's mean across nodes; the warm-up's in its wire (bf16: torch's bf16_compress_hook's)
        wire = wire_dtype_of(state.warmup_wire if warmup else state.full_wire)
        f_full = mean_allreduce_async(fp, inter, "bitdp.full.allreduce", traffic, wire)
    if f_q is not None:
        q, raised = f_q.wait()
        parts.append(q.to(buf.dtype).masked_fill_(raised, float("nan")))
        for key, e in (residuals or {}).items():
            old = state.residuals.get(key)
            kept = e.masked_fill_(raised, 0) if old is None else torch.where(raised, old.to(e.device), e)
            state.residuals[key] = kept
    if fp is not None:
        f_full.wait()
        parts.append(fp.to(buf.dtype))
    longest = max(lengths)
    block = buf.new_zeros(longest)
    if parts:
        mine_flat = torch.cat(parts)
        block[: mine_flat.numel()] = mine_flat
    every = buf.new_empty(longest * per_node)
    fut = g.all_gather_async(every, block, topo.intra, "node.all_gather", sync.node_traffic)

    def assemble(f: torch.futures.Future) -> torch.Tensor:
        gathered = f.value().view(per_node, longest)
        full_views = _full_runs(buf, runs)
        for i, ((lo_i, hi_i), mine_i) in enumerate(zip(slices, pieces)):
            at = 0
            for k, a, b in mine_i:
                n = (b - a) * rows[k][0].numel()
                rows[k][a:b].copy_(gathered[i, at : at + n].view(rows[k][a:b].shape))
                at += n
            _scatter(full_views, lo_i, gathered[i, at : at + hi_i - lo_i])
        return buf

    return chain.then(fut, assemble)


def _scatter(views: list[torch.Tensor], lo: int, values: torch.Tensor) -> None:
    """Write ``values`` at positions ``lo ..`` of the concatenation of ``views``."""
    start = 0
    for v in views:
        n = v.numel()
        a, b = max(lo, start), min(lo + values.numel(), start + n)
        if b > a:
            v[a - start : b - start].copy_(values[a - lo : b - lo])
        start += n
