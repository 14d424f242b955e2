"""The planner's sharded rows: FSDP inside the node with the exchange across nodes
(``--sharded``: HSDP bf16, Lion Cub, 1-bit Adam/LAMB, TurboQuant), and one FSDP group over
every rank (``fsdp_shard="world"``), priced on a :class:`~lowbit_strategy.plan.predict.Predictor`
by the byte formulas of :mod:`~lowbit_strategy.pricing.sharded` and
:mod:`~lowbit_strategy.pricing.world` (the step-time rules are
:mod:`~lowbit_strategy.plan.predict`'s)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from lowbit_strategy.plan.rows import ONEBIT_BLOCK, TURBOQUANT_FORMS, Row, turboquant_codec_ns
from lowbit_strategy.pricing import sharded as sh
from lowbit_strategy.pricing import world as cw
from lowbit_strategy.pricing.nodes import bucket_seconds, bucket_sends

if TYPE_CHECKING:
    from lowbit_strategy.plan.predict import Predictor


def _sharded(pr: Predictor, key, method, config, sends: sh.ShardedSends, codec_key, memory) -> Row:
    """A sharded row: the exchange across nodes hidden behind backward unit by unit like DDP's
    buckets — HSDP's all-reduce hook, and the sharded algorithms' exchange, started from FSDP2's
    post-accumulate-grad hooks (their sections' default ``overlap``)."""
    t = sh.sharded_seconds(sends, pr.c)
    units = max(1, len(pr.s.model.units))
    link = float(sends.network_per_node)
    local = pr.n / pr.per_node
    per = [(t / units, link / units)] * units
    return pr.row(key, method, "sharded", config, per, pr.codec(codec_key, local), memory / pr.per_node, True)


def sharded_rows(pr: Predictor, lion_lane: str) -> list[Row]:
    """HSDP bf16 and each low-bit exchange across nodes (Lion Cub at ``lion_lane``, 1-bit
    Adam/LAMB, TurboQuant with its per-bucket ``auto`` form) on FSDP shards of 1/L."""
    shapes, units = list(pr.s.model.shapes), pr.s.model.unit_shapes()
    nodes, per_node, bn, n = pr.nodes, pr.per_node, pr.s.bucket_numel, pr.n

    def tq(m: int) -> str:  # TurboQuant's auto per bucket at P = N (codec time included)
        cost = {
            f: bucket_seconds(bucket_sends(f, m, nodes, flagged=False), replace(pr.c, nodes=nodes, ranks_per_node=1))
            + m * turboquant_codec_ns(pr.s.codec_ns, f, nodes) * 1e-9
            for f in TURBOQUANT_FORMS
        }
        return min(cost, key=cost.__getitem__)

    pick: Callable[[int], str] = tq
    hsdp = sh.hsdp_sends(units, nodes, per_node, itemsize=2)
    lion = sh.launched_sends(lion_lane, units, nodes, per_node)  # one flagged bucket per FSDP unit
    onebit = sh.optimizer_sends(
        "compensated", shapes, nodes, per_node, bucket_numel=bn, last_first=True, block=ONEBIT_BLOCK
    )
    turbo = sh.optimizer_sends(pick, shapes, nodes, per_node, bucket_numel=bn, last_first=True)
    server = 4.0 * n / max(1, nodes)
    return [
        _sharded(pr, "hsdp_bf16", "HSDP bf16 (+ AdamW)", "FSDP2 + replicate, bf16 reduce", hsdp, None, 8.0 * n),
        _sharded(pr, "lion_sharded", f"Lion Cub {lion_lane}", "attach_sharded(algorithm='lion')", lion, "lp", 4.0 * n),
        _sharded(
            pr,
            "onebit_sharded",
            "1-bit Adam/LAMB",
            "attach_sharded(algorithm='onebit_adam')",
            onebit,
            "compensated",
            12.0 * n + server,
        ),
        _sharded(
            pr,
            "turboquant_sharded",
            "TurboQuant-Adam 4-bit",
            "attach_sharded(algorithm='turboquant')",
            turbo,
            "turboquant",
            12.0 * n + server,
        ),
    ]


def hsdp_warmup_step(pr: Predictor, wire: str = "bf16") -> float:
    """The sharded low-bit rows' warm-up step: the mean across nodes in ``wire``
    (``LowBitConfig.warmup_wire``), reduced unit by unit during backward as HSDP does
    (:mod:`lowbit_strategy.integrations.sharded`)."""
    sends = sh.hsdp_sends(pr.s.model.unit_shapes(), pr.nodes, pr.per_node, itemsize=2 if wire == "bf16" else 4)
    return _sharded(pr, f"hsdp_{wire}", f"HSDP {wire}", "", sends, None, 0.0).step_s


def world_rows(pr: Predictor) -> list[Row]:
    """FSDP over all W ranks, for a model that does not fit one node: parameters gathered
    in bf16 in forward and again in backward, gradients reduce-scattered exact in bf16 or
    as int4 in two hops (exact inside the node, quantized across), bytes and α–β seconds
    from :mod:`~lowbit_strategy.pricing.world`. FSDP2 prefetches: the
    forward's gathers hide behind forward compute, the backward's behind backward, except
    one unit's each (the first gather waits, the last reduce-scatter ends the step). The
    two-hop row's intra-node hop is timed on the intra link, and its codec (``blockwise``
    encode + decode of ``codec_ns``) over the 1/L of the gradient a rank sends across."""
    units = pr.s.model.unit_shapes()
    k = max(1, sum(1 for u in units if u))
    forward = pr.s.compute.seconds - pr.backward
    out = []
    for key, method, config, rs, two_hop, errors in (
        ("fsdp_world_bf16", "FSDP world bf16 (+ AdamW)", "fsdp_shard='world', bf16 reduce", "bf16", False, 0.0),
        (
            "fsdp_world_int4",
            "FSDP world int4 (+ AdamW)",
            "fsdp_shard='world', fsdp_reduce_scatter='int4'",
            "int4",
            True,
            0.0,  # fsdp_error_feedback is off by default (on: 4 B/param over L, N·c fp32 per rank)
        ),
    ):
        sends = cw.world_sends(
            units,
            pr.nodes,
            pr.per_node,
            reduce_scatter=rs,
            two_hop=two_hop,
            param_itemsize=2,
            reduce_itemsize=2,
        )
        fwd, bwd = cw.world_seconds(sends, pr.c)
        bwd += 8 * sends.total.node / (pr.c.intra_gbps * 1e9)
        exposed = max(fwd - forward, fwd / k) + max(bwd - pr.backward, bwd / k)
        codec = pr.codec("blockwise" if rs != "bf16" else None, pr.n / pr.per_node)
        step = pr.s.compute.seconds + exposed + codec
        memory = 8.0 * pr.n / pr.p + errors
        out.append(Row(key, method, "world", config, float(sends.link), fwd + bwd, exposed, codec, step, memory))
    return out
