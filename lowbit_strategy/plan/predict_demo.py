"""The planner's DeMo rows: decoupled momentum, every step, priced by its payload.

A worker is a node (hierarchical, ≥ 2 nodes of ≥ 2 ranks; a rank otherwise); inside the node
DDP's exact mean of the gradient runs every step, overlapped with backward like DDP's. Each
step every worker's payload (:func:`~lowbit_strategy.codecs.topk.layout`: the top-k DCT
coefficients of every 64 x 64 chunk of its momentum, indices packed to 12 bits, values fp32 or
1 bit plus a bf16 scale per chunk) is all-gathered across the workers: a node's link carries
``N − 1`` payloads out and in (the all-gather's bytes grow with the workers, unlike an
allreduce's), at ``N − 1`` latencies. With ``delay = 0`` the exchange is exposed at the step;
with ``delay = 1`` it overlaps the next step's compute: exposed ``max(0, t − step)``.

The codec (three chunked transforms and the top-k per step) is priced from a measured
``codec_ns["demo"]`` per element when the one-GPU check has it, else not at all (say so).

Memory per GPU: the momentum δ (4 B/param), the optimizer's only state; sharded, over L.
"""

from __future__ import annotations

from lowbit_strategy.codecs.topk import layout
from lowbit_strategy.collectives import wire
from lowbit_strategy.plan.rows import Row
from lowbit_strategy.plan.workers import workers_of

__all__ = ["DEMO_FORMS", "demo_rows"]

#: (key, label, values, topk, delay): the rows priced (chunk 64: DeMo's)
DEMO_FORMS = (
    ("fp32_k32", "DeMo fp32 top-32", "fp32", 32, 0),
    ("sign_k32", "DeMo 1-bit top-32", "sign", 32, 0),
    ("sign_k8_d1", "DeMo 1-bit top-8, delay 1", "sign", 8, 1),
)
CHUNK = 64


def demo_rows(pr) -> list[Row]:
    """The DeMo rows of :class:`~lowbit_strategy.plan.predict.Predictor` ``pr``."""
    s, c = pr.s, pr.c
    w = workers_of(pr)
    workers, inner, bps, alpha, form = w.count, w.inner_s, w.bps, w.alpha, w.form
    n = s.model.numel
    compute = s.compute.seconds
    shard = 1 if not s.sharded else c.ranks_per_node
    rows = []
    for key, label, values, topk, delay in DEMO_FORMS:
        _, payload = layout(s.model.shapes, CHUNK, topk, values)
        link = wire.all_gather_bytes(payload, workers)  # leaving each node (its ranks' shares together)
        t_sync = (workers - 1) * alpha + 8 * link / bps if workers > 1 else 0.0
        step = compute + inner
        exposed = max(0.0, t_sync - delay * step)
        codec = pr.codec("demo", n)
        config = f"algorithm='demo', values='{values}', delay={delay}, topology='{form}'; DeMo(compression_topk={topk})"
        rows.append(
            Row(
                f"demo_{key}_{form}",
                label,
                form,
                config,
                link,
                t_sync,
                exposed,
                codec,
                step + exposed + codec,
                4.0 * n / shard,
            )
        )
    return rows
