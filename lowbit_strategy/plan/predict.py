"""The planner's predictions: per method and form, bytes per step on each node's link, the
step time, and the optimizer + compression memory per GPU, from the exact byte formulas of
:mod:`~lowbit_strategy.pricing.nodes` (flat and hierarchical) and
:mod:`~lowbit_strategy.pricing.sharded` (FSDP inside the node, the exchange
across nodes), timed by their α–β model on the given cluster.

**Step time** = compute + exposed communication + codec time (steady state: warm-up steps,
which send bf16 (PowerSGD's fp32), are priced only over a whole run, :mod:`~lowbit_strategy.plan.warmup`):

* DDP, PowerSGD and the overlapping methods start each bucket's collective during backward,
  taken as 2/3 of compute: ``exposed = max(comm - backward, the last bucket's comm)`` (the
  last bucket is ready only when backward ends);
* the FSDP world rows (``--sharded`` on several nodes: one FSDP group over every rank,
  :func:`~lowbit_strategy.plan.predict_sharded.world_rows`) gather in forward and backward and reduce-scatter in
  backward, hidden behind each but one unit's call;
* the sharded rows exchange at the optimizer step: none of it is hidden (HSDP's all-reduce
  hook overlaps backward like DDP);
* codec time (encode + decode, per element, :class:`Setup.codec_ns`) is added in full,
  not overlapped: on a GPU the codec's kernels take the SMs from backward. Without codec
  figures it is not counted, which flatters the low-bit rows (the table says so);
* 1-bit Adam's and 1-bit LAMB's compression-stage step beyond AdamW's (LAMB's trust ratios,
  the staged optimizers' extra passes: ``onebit_adam_step``/``onebit_lamb_step`` of
  ``codec_ns``, per element the rank steps) is added to their rows' codec column, since
  the compute time (a calibration step, ``--measure``, or FLOPs) holds AdamW's step at most.

**Memory** (fp32 state per GPU, without weights, gradients and activations): AdamW's two
moments 8 B/param, Lion's one 4 B; 1-bit Adam/LAMB and TurboQuant add a worker error
(4 B) and a server error on their 1/P chunk; PowerSGD its error feedback (4 B); BitDP
none by default (``error_feedback`` off); the sharded rows divide all of it by L, the FSDP
world rows by W (AdamW's 8 B/param; the int4 row without error feedback, off by default:
``fsdp_error_feedback`` would add 4 B/param over L). With a
GPU's memory known, a row **fits** when that plus fp32 weights and gradients (8 B/param, /L
sharded, /W world) stays within it; activations are not counted, so a row that fits may still not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

from lowbit_strategy import buckets
from lowbit_strategy.collectives import wire
from lowbit_strategy.collectives.exact import exact_wire
from lowbit_strategy.collectives.gathered import PayloadLayout
from lowbit_strategy.plan.inputs import Compute, Model
from lowbit_strategy.plan.predict_demo import demo_rows
from lowbit_strategy.plan.predict_diloco import diloco_rows
from lowbit_strategy.plan.predict_sharded import hsdp_warmup_step, sharded_rows, world_rows
from lowbit_strategy.plan.rows import (  # noqa: F401 - TURBOQUANT_FORMS, turboquant_codec_ns: part of this module's API
    ONEBIT_BLOCK,
    POWERSGD_MIN_RATE,
    POWERSGD_RANK,
    TURBOQUANT_FORMS,
    Row,
    as_matrix,
    turboquant_codec_ns,
)
from lowbit_strategy.plan.warmup import Run, whole_run
from lowbit_strategy.pricing.flat import bitdp_form, rounds
from lowbit_strategy.pricing.nodes import (
    Cluster,
    NodeSends,
    Sends,
    bitdp_hierarchical_sends,
    bitdp_sends,
    bucket_seconds,
    bucket_sends,
    hierarchical_sends,
)

#: backward's share of the compute time (forward 1/3: 2·N·tokens of 6·N·tokens FLOPs)
BACKWARD_SHARE = 2 / 3


@dataclass(frozen=True)
class Setup:
    """Everything a prediction depends on."""

    model: Model
    cluster: Cluster
    compute: Compute
    bucket_size_mb: float = 25.0
    sharded: bool = False
    #: encode + decode nanoseconds per element by codec (``lp``, ``1bit``, ``compensated``,
    #: ``turboquant``, ``bitdp``, ``powersgd``) and the 1-bit optimizers' step beyond AdamW's
    #: (``onebit_adam_step``, ``onebit_lamb_step``), or None: codec time not counted
    codec_ns: dict[str, float] | None = None
    codec_note: str = "codec time not counted (no codec figures; pass --measure-codecs)"
    #: bytes of memory per GPU, or None: unknown, every row is taken to fit
    gpu_memory: float | None = None
    #: the forms TurboQuant's ``auto`` chooses among per bucket (a check against a run that
    #: compressed passes the compressed ones: the run's own choice, not the planner's)
    turboquant_forms: tuple[str, ...] = TURBOQUANT_FORMS
    #: the run to price, warm-ups included (``--steps``), or None: the steady-state step only
    run: Run | None = None
    #: H of the DiLoCo rows (:mod:`~lowbit_strategy.plan.predict_diloco`); 0: no DiLoCo rows
    diloco_sync_every: int = 100
    #: whether to price the DeMo rows (:mod:`~lowbit_strategy.plan.predict_demo`)
    demo: bool = True

    @property
    def bucket_numel(self) -> int:
        return max(1, int(self.bucket_size_mb * 2**20 / 4))


class Predictor:
    def __init__(self, setup: Setup):
        self.s, c = setup, setup.cluster
        self.c, self.p, self.nodes, self.per_node = c, c.world_size, c.nodes, c.ranks_per_node
        order = list(reversed(range(len(setup.model.shapes))))  # DDP's buckets: last parameter first
        numels = [math.prod(setup.model.shapes[i]) for i in order]
        self.bucket_ids = [[order[i] for i in idx] for idx in buckets.partition(numels, setup.bucket_numel)]
        self.buckets = [[setup.model.shapes[i] for i in ids] for ids in self.bucket_ids]
        self.sizes = [sum(math.prod(x) for x in b) for b in self.buckets]
        self.n = setup.model.numel
        self.backward = BACKWARD_SHARE * setup.compute.seconds
        self.time = lru_cache(maxsize=None)(self._time)

    # -- one bucket --------------------------------------------------------------------------
    def _sends(self, name: str, n: int, form: str, flagged: bool, align: int, block: int | None):
        if form == "flat":
            return bucket_sends(name, n, self.p, flagged=flagged, block=block)
        return hierarchical_sends(name, n, self.nodes, self.per_node, align=align, flagged=flagged, block=block)

    def _time(self, name: str, n: int, form: str, flagged: bool, align: int, block: int | None):
        sends = self._sends(name, n, form, flagged, align, block)
        return bucket_seconds(sends, self.c), self._link(sends)

    def _link(self, sends: Sends | NodeSends) -> float:
        if isinstance(sends, NodeSends):
            return float(sends.network_per_node)
        return sends.link_bytes(self.p, self.per_node)

    def codec(self, key: str | None, elements: float) -> float:
        ns = (self.s.codec_ns or {}).get(key or "", 0.0)
        return ns * 1e-9 * elements

    def row(self, key, method, form, config, per_bucket: list[tuple[float, float]], codec_s, memory, overlap=True):
        comm = sum(t for t, _ in per_bucket)
        last = per_bucket[-1][0] if per_bucket else 0.0
        exposed = max(comm - self.backward, last) if overlap else comm
        step = self.s.compute.seconds + exposed + codec_s
        link = sum(b for _, b in per_bucket)
        return Row(key, method, form, config, link, comm, exposed, codec_s, step, memory)

    # -- flat and hierarchical ----------------------------------------------------------------
    def simple(
        self, key, method, form, config, name, codec_key, memory, flagged=False, align=64, block=None, step_key=None
    ):
        """A row whose every bucket goes one way; ``step_key`` the optimizer's step beyond
        AdamW's (``codec_ns``), over every parameter (each rank steps a full replica)."""
        per = [self.time(name, n, form, flagged, align, block) for n in self.sizes]
        share = self.n / (self.per_node if form == "hierarchical" else 1)
        codec = self.codec(codec_key, share) + self.codec(step_key, self.n)
        return self.row(key, method, form, config, per, codec, memory)

    def turboquant(self, form: str, memory: float) -> Row:
        per, codec = [], 0.0
        ranks = self.p if form == "flat" else self.nodes
        for n in self.sizes:
            share = n / (self.per_node if form == "hierarchical" else 1)
            options = [
                (self.time(f, n, form, True, 1024, None), share * turboquant_codec_ns(self.s.codec_ns, f, ranks) * 1e-9)
                for f in self.s.turboquant_forms
            ]
            (t, b), c = min(options, key=lambda o: o[0][0] + o[1])
            per.append((t, b))
            codec += c
        config = f"algorithm='turboquant', topology='{'flat' if form == 'flat' else 'hierarchical'}'"
        return self.row(f"turboquant_{form}", "TurboQuant-Adam 4-bit", form, config, per, codec, memory)

    def bitdp(self, form: str, full_itemsize: int = 4) -> Row:
        """BitDP 2-bit's row; ``full_itemsize``: bytes per element of what it does not code
        (4: its fp32 allreduce; 2: bf16, as the staged optimizers' ``int2`` warm-up sends it)."""
        per, lat, bw = [], self.c.inter_latency_us * 1e-6, self.c.inter_gbps * 1e9
        model = self.s.model
        for ids in self.bucket_ids:
            mats = [m for i in ids if model.bitdp_quantized(i) and (m := as_matrix(model.shapes[i]))]
            full = sum(
                math.prod(model.shapes[i]) for i in ids if not (model.bitdp_quantized(i) and as_matrix(model.shapes[i]))
            )
            ranks = self.p if form == "flat" else self.nodes
            how = bitdp_form("auto", PayloadLayout.of(mats, 2), ranks, lat, bw) if mats and ranks > 1 else "allgather"
            if form == "flat":
                sends: Sends | NodeSends = bitdp_sends(how, mats, full, self.p, itemsize=full_itemsize)
            else:
                sends = bitdp_hierarchical_sends(how, mats, full, self.nodes, self.per_node, itemsize=full_itemsize)
            per.append((bucket_seconds(sends, self.c), self._link(sends)))
        share = self.n / (self.per_node if form == "hierarchical" else 1)
        config = f"algorithm='bitdp', topology='{'flat' if form == 'flat' else 'hierarchical'}'"
        return self.row(
            f"bitdp_{form}", "BitDP 2-bit (+ AdamW)", form, config, per, self.codec("bitdp", share), 8.0 * self.n
        )

    def powersgd(self) -> Row:
        per = []
        alpha = self.c.inter_latency_us * 1e-6 if self.p > self.per_node else self.c.intra_latency_us * 1e-6
        for bucket in self.buckets:
            plain = ps = qs = 0
            for x in bucket:
                m = as_matrix(x)
                if m and (m[0] + m[1]) * POWERSGD_RANK * POWERSGD_MIN_RATE < m[0] * m[1]:
                    ps, qs = ps + m[0] * POWERSGD_RANK, qs + m[1] * POWERSGD_RANK
                else:
                    plain += math.prod(x)
            parts = [k for k in (plain, ps, qs) if k]
            sends = Sends(allreduce=sum(wire.allreduce_bytes(4 * k, self.p) for k in parts))
            extra = (len(parts) - 1) * 2 * rounds(self.p) * alpha  # three allreduces, not one
            per.append((bucket_seconds(sends, self.c) + extra, self._link(sends)))
        memory = 8.0 * self.n + 4.0 * sum(math.prod(x) for b in self.buckets for x in b if as_matrix(x))
        codec = self.codec("powersgd", self.n)  # the low-rank products over every gradient element
        return self.row(
            "powersgd",
            f"PowerSGD rank {POWERSGD_RANK} (+ AdamW)",
            "flat",
            "DDP comm hook powerSGD_hook",
            per,
            codec,
            memory,
        )


def predict(setup: Setup) -> list[Row]:
    """Every row of the plan (module docstring), with speed-ups over DDP bf16."""
    from lowbit_strategy.algorithms.lion_cub.mode import auto_candidates
    from lowbit_strategy.config import LowBitConfig

    pr, n = Predictor(setup), setup.model.numel
    lion_cfg = LowBitConfig(algorithm="lion", link_bandwidth_gbps=1, link_latency_us=0)
    forms = ["flat"] + (["hierarchical"] if setup.cluster.nodes > 1 and setup.cluster.ranks_per_node > 1 else [])
    rows = [
        pr.simple("ddp_fp32", "DDP fp32 (+ AdamW)", "flat", "plain DDP", "ddp", None, 8.0 * n),
        pr.simple("ddp_bf16", "DDP bf16 (+ AdamW)", "flat", "DDP comm hook bf16_compress_hook", "bf16", None, 8.0 * n),
        pr.powersgd(),
    ]
    for form in forms:
        ranks = setup.cluster.world_size if form == "flat" else setup.cluster.nodes
        lane = auto_candidates(lion_cfg, ranks, 0)[0]
        topo = "flat" if form == "flat" else "hierarchical"
        server = 4.0 * n / ranks
        rows += [
            pr.simple(
                f"lion_{lane}_{form}",
                f"Lion Cub {lane}",
                form,
                f"algorithm='lion', mode='lp', bits={lane[2:]}, topology='{topo}'",
                lane,
                "lp",
                4.0 * n,
                flagged=True,
            ),
            pr.simple(
                f"lion_1bit_{form}",
                "Lion Cub 1-bit",
                form,
                f"algorithm='lion', mode='1bit', momentum_sync_every=..., topology='{topo}'",
                "1bit",
                "1bit",
                4.0 * n,
                flagged=True,
            ),
            *(
                pr.simple(
                    f"{prefix}_{form}",
                    label,
                    form,
                    f"algorithm='{algo}', topology='{topo}'",
                    "compensated",
                    "compensated",
                    12.0 * n + server,
                    align=ONEBIT_BLOCK,
                    block=ONEBIT_BLOCK,
                    step_key=f"{algo}_step",
                )
                for prefix, label, algo in (
                    ("onebit", "1-bit Adam", "onebit_adam"),
                    ("onebit_lamb", "1-bit LAMB", "onebit_lamb"),
                )
            ),
            pr.turboquant(form, 12.0 * n + server),
            pr.bitdp(form),
        ]
    if setup.diloco_sync_every > 0:
        rows += diloco_rows(pr, setup.diloco_sync_every)
    if setup.demo:
        rows += demo_rows(pr)
    if setup.sharded:
        lane = auto_candidates(lion_cfg, setup.cluster.nodes, 0)[0]
        rows += sharded_rows(pr, lane)
        if setup.cluster.nodes > 1:
            rows += world_rows(pr)
    base = next(r for r in rows if r.key == "ddp_bf16").step_s
    shards = {"sharded": setup.cluster.ranks_per_node, "world": setup.cluster.world_size}

    def fits(r: Row) -> bool | None:
        if setup.gpu_memory is None:
            return None
        return r.memory_bytes + 8.0 * n / shards.get(r.form, 1) <= setup.gpu_memory

    rows = [replace(r, speedup=base / r.step_s, fits=fits(r)) for r in rows]
    if setup.run is None:
        return rows
    wire = setup.run.warmup_wire
    exact = exact_wire(wire)
    step = {r.key: r.step_s for r in rows}
    # PowerSGD's warm-up is torch's fp32; this package's in warmup_wire, in the row's own form
    # (int2: BitDP 2-bit's step, bf16 for what it does not code)
    coded = wire == "int2"
    warm = {"powersgd": step["ddp_fp32"], "flat": pr.bitdp("flat", 2).step_s if coded else step[f"ddp_{wire}"]}
    if "hierarchical" in forms:  # exact inside each node, the wire across
        hier = pr.bitdp("hierarchical", 2) if coded else pr.simple(wire, wire, "hierarchical", "", wire, None, 0.0)
        warm["hierarchical"] = hier.step_s
    if setup.sharded:  # (int2 priced as HSDP bf16's, an upper bound: no sharded BitDP row here)
        warm["sharded"] = hsdp_warmup_step(pr, exact)
    return whole_run(rows, setup.run, warm)
