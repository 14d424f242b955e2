"""The planner's DiLoCo rows: local updates priced per step, amortized over the round.

A worker is a node (hierarchical, ≥ 2 nodes of ≥ 2 ranks; a rank otherwise). Per inner step:
the compute, plus (hierarchical) DDP's exact node mean on the intra-node link, overlapped with
backward like DDP's. Every ``H`` steps: the pseudo-gradient exchange across nodes, by the
exchange's own byte formula (:func:`~lowbit_strategy.algorithms.diloco.exchange.payload_bytes`;
each local rank sends its 1/L shard over its own cross-node group, so a node's link carries one
payload), at ``rounds(N)`` latencies for the allreduce forms and ``N − 1`` for the all-gathers.
Without ``delay`` the exchange blocks the step it follows: ``H``-th of it is exposed per step.
The streaming row (F fragments, ``delay`` τ) sends 1/F of the payload every H/F steps, each
hidden behind τ inner steps: exposed ``max(0, t_sync/F − τ·step)`` per H/F steps.

Memory per GPU: the inner AdamW (8 B/param), the global copy and outer momentum (8 B), and the
error buffer (4 B/param) of the low-bit forms; sharded (``--sharded``) all of it over L.
"""

from __future__ import annotations

from lowbit_strategy.algorithms.diloco.exchange import payload_bytes
from lowbit_strategy.plan.rows import Row
from lowbit_strategy.plan.workers import workers_of
from lowbit_strategy.pricing.flat import rounds

__all__ = ["DILOCO_FORMS", "diloco_rows"]

#: (key, label, compression, fragments, delay): the rows priced
DILOCO_FORMS = (
    ("fp32", "DiLoCo fp32 outer sync", "fp32", 1, 0),
    ("int4", "DiLoCo int4 outer sync", "int4", 1, 0),
    ("sign", "DiLoCo 1-bit outer sync", "sign", 1, 0),
    ("streaming_int4", "Streaming DiLoCo int4", "int4", 4, 2),  # F = 4 fragments, delay τ = 2
)


def diloco_rows(pr, sync_every: int) -> list[Row]:
    """The DiLoCo rows of :class:`~lowbit_strategy.plan.predict.Predictor` ``pr`` at ``H = sync_every``."""
    s, c = pr.s, pr.c
    w = workers_of(pr)
    workers, per_node, inner, bps, alpha, form = w.count, w.per_node, w.inner_s, w.bps, w.alpha, w.form
    n = s.model.numel
    compute = s.compute.seconds
    topo = form
    shard = 1 if not s.sharded else c.ranks_per_node
    rows = []
    for key, label, compression, fragments, delay in DILOCO_FORMS:
        part = -(-n // (per_node * fragments))  # each local rank's shard of one fragment
        sent = payload_bytes(compression, part, workers) * per_node if workers > 1 else 0  # leaving each node
        gathers = compression not in ("fp32", "bf16", "sign")
        lat = (workers - 1 if gathers else 2 * rounds(workers)) * alpha if workers > 1 else 0.0
        t_sync = lat + 8 * sent / bps  # one fragment's exchange
        step = compute + inner
        exposed = max(0.0, t_sync - delay * step) * fragments / sync_every
        link = sent * fragments / sync_every
        codec = pr.codec(compression, n / per_node) / sync_every
        error = 4.0 if compression not in ("fp32",) else 0.0
        memory = (16.0 + error) * n / shard
        config = f"algorithm='diloco', sync_every={sync_every}, compression='{compression}', topology='{topo}'"
        if fragments > 1:
            config += f", fragments={fragments}, delay={delay}"
        rows.append(
            Row(
                f"diloco_{key}_{form}",
                label,
                form,
                config,
                link,
                t_sync * fragments / sync_every,
                exposed,
                codec,
                step + exposed + codec,
                memory,
            )
        )
    return rows
