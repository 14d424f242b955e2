"""Who the workers are for the rows of algorithms whose unit is a worker, not a rank (DiLoCo,
DeMo): a node under the hierarchical topology (≥ 2 nodes of ≥ 2 ranks), a rank otherwise; the
link the workers share and what the node's own step adds."""

from __future__ import annotations

from dataclasses import dataclass

from lowbit_strategy.collectives import wire
from lowbit_strategy.pricing.flat import rounds

__all__ = ["Workers", "workers_of"]


@dataclass(frozen=True)
class Workers:
    """count: workers; per_node: ranks that share one worker's exchange (its local ranks);
    inner_s: what DDP's exact node mean adds to each step beyond backward (hierarchical);
    bps / alpha: the link between workers; form: the row's form."""

    count: int
    per_node: int
    inner_s: float
    bps: float
    alpha: float
    form: str

    @property
    def hierarchical(self) -> bool:
        return self.form == "hierarchical"


def workers_of(pr) -> Workers:
    """The workers of :class:`~lowbit_strategy.plan.predict.Predictor` ``pr``'s cluster."""
    c = pr.c
    hierarchical = c.nodes > 1 and c.ranks_per_node > 1
    inner = 0.0
    if hierarchical:  # DDP's node mean every step, on NVLink, overlapped with backward
        t = rounds(c.ranks_per_node) * c.intra_latency_us * 1e-6
        t += 8 * wire.allreduce_bytes(4 * pr.s.model.numel, c.ranks_per_node) / (c.intra_gbps * 1e9)
        inner = max(0.0, t - pr.backward)
    one_node = c.nodes == 1
    return Workers(
        count=c.nodes if hierarchical else c.world_size,
        per_node=c.ranks_per_node if hierarchical else 1,
        inner_s=inner,
        bps=(c.intra_gbps if one_node else c.inter_gbps) * 1e9,
        alpha=(c.intra_latency_us if one_node else c.inter_latency_us) * 1e-6,
        form="hierarchical" if hierarchical else "flat",
    )
