"""LionCommunicator: how a distributed Lion Cub synchronizes its update vectors.

The optimizer hands it the per-parameter update vectors c_i = β1·m_i + (1-β1)·g_i of this
rank; it returns the direction sign(Σ_i Q(c_i)) of Lion Cub Algorithm 1, line 4-5, for
every parameter, computed through one compressed collective per bucket:

* ``1bit``: majority vote of the signs (all-to-all + all-gather, alternating ties; a tie
  cannot be sent in one bit, so the direction is never 0);
* ``sign``: 0/1 votes summed exactly in packed lanes (Lion Cub's "4-bit": {-1,1} -> {0,1});
  a tied vote gives direction 0, exactly like sign(0) in Lion;
* ``lp``: each parameter's c_i is L_p-quantized with its own scale M_p (Eq. 1; layers differ
  by orders of magnitude, Sec. 4.1) to levels L chosen so that the sum over P ranks fits the
  lane (2·L·P <= capacity), then summed exactly (Lion Cub's "8-bit L1");
* ``fp32`` / ``bf16``: the exact sum (the uncompressed baseline).

``auto`` resolves once, at the first step, from P, the bucket size and the configured link:
see :func:`~.plan.resolve_mode`. The first ``warmup_steps`` steps synchronize the uncompressed
sum in ``LowBitConfig.warmup_wire`` (``bf16`` by default, ``fp32``). With one rank
nothing is sent and the direction is sign(c), so a world of one is plain Lion bit for bit.
Zero-element tensors take no part in any collective (their direction is the empty tensor).

Across nodes (``topology``, :mod:`lowbit_strategy.collectives.hierarchy`) the node is the
worker: its ranks hold the node's mean gradient (the DDP hook reduced it) and so the same
c, and the plan is made for N nodes. Each local rank encodes the whole bucket as the flat
algorithm would, sends only its shard of the payload over its cross-node group, and the
node all-gathers the shards' directions: the flat algorithm with N workers, shard by shard,
bit for bit (every mode's code is per element; the L_p scale is per parameter and is
computed before the payload is cut).

It also averages momenta across ranks (selective momentum sync, Sec. 5), agrees on which
parameters have gradients and whether any rank saw a non-finite one, and can audit a step
against the full-precision direction (sign match / flip rates, Fig. 4). Every byte goes
through :mod:`lowbit_strategy.collectives` and lands in :attr:`traffic`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch

from lowbit_strategy import buckets
from lowbit_strategy.algorithms.lion_cub.mode import (
    EXACT_MODES,
    SyncMode,
    auto_candidates,
    lion_section,
    measure_codec_seconds,
    resolve_mode,
)
from lowbit_strategy.codecs import lp_quantize_many, sign_bits
from lowbit_strategy.collectives import full_allreduce, wire
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.agreement import agree, check_same
from lowbit_strategy.collectives.exact import full_allreduce_start
from lowbit_strategy.collectives.hierarchy import Topology
from lowbit_strategy.collectives.inflight import InFlight, Launched, finish
from lowbit_strategy.collectives.majority import MajorityVote, majority_vote_start
from lowbit_strategy.collectives.shards import ShardSpec, pad_empty, spec_for, take
from lowbit_strategy.collectives.summed import summed_allreduce_start
from lowbit_strategy.pricing.calibration import agreed_slowest
from lowbit_strategy.validation import ConfigError

if TYPE_CHECKING:  # the config reads the registry, which imports this module: annotations only
    from lowbit_strategy.config import LowBitConfig

logger = logging.getLogger(__name__)


@dataclass
class _LionJob(Launched):
    """One Lion bucket in flight: the parameters it covers (the overlap path; empty at the
    step) and this rank's update vectors c, in bucket order."""

    params: list = field(default_factory=list)
    chunk: list = field(default_factory=list)


class _Directions:
    """One bucket's collective as a :class:`~lowbit_strategy.collectives.group.Flagging`
    handle, whatever the plan: :meth:`gather` starts the majority vote's second phase (once),
    :meth:`wait` gives the direction sign(Σ Q(c)) of this rank's part of the bucket, and
    :meth:`nonfinite` the verdict that rode inside the payload (None when none did).
    ``inner`` is the collective's own handle (its tensors are what a side stream records)."""

    def __init__(self, inner: g.Pending | MajorityVote, plan: SyncMode, part: int, flagged: bool, world: int, dtype):
        self.inner, self.plan, self.part, self.flagged = inner, plan, part, flagged
        self.world, self.dtype = world, dtype
        self._pending: g.Waitable | None = None
        self._result: torch.Tensor | None = None
        self._bad: torch.Tensor | None = None

    def gather(self) -> _Directions:
        if self._pending is None:
            self._pending = cast(MajorityVote, self.inner).gather() if self.plan.mode == "1bit" else self.inner
        return self

    def wait(self) -> torch.Tensor:
        if self._result is None:
            result = self.gather()._pending.wait()  # type: ignore[union-attr]
            n = self.part  # where a flag follows
            if self.plan.mode == "1bit":
                if self.flagged:
                    flags = cast(MajorityVote, self.inner).flags  # every rank's flag, set by gather()
                    if flags is None:
                        raise RuntimeError("a flagged majority vote has no flags after its all-to-all")
                    self._bad = flags.sum() > 0
                self._result = result
            else:
                if self.flagged:
                    self._bad = result[n] > 0
                result = result[:n]
                if self.plan.mode == "sign":
                    result = 2 * result - self.world
                self._result = torch.sign(result).to(self.dtype)
        return self._result

    def nonfinite(self) -> torch.Tensor:
        if self._bad is None:
            raise RuntimeError("_Directions.nonfinite() needs a flagged collective, after wait()")
        return self._bad


class LionCommunicator:
    """Process group + config: synchronizes a distributed Lion's update vectors.

    Two ways in, with the same result bit for bit:

    * :meth:`directions` (the optimizer's ``step()``): every bucket is started, then every
      bucket finished;
    * :meth:`launch` from the DDP communication hook, one bucket at a time as backward
      produces it (the collective overlaps the rest of backward), then :meth:`collect` in
      ``step()``. A non-finite flag travels inside each bucket's payload (an extra code, an
      extra element, or one byte per peer of the majority vote's all-to-all), so the step
      learns whether any rank saw NaN/Inf without another collective.

    Collectives are launched in bucket order, which is the same on every rank (DDP hands
    buckets over in the same order everywhere); a second collective that depends on the
    first's result (the majority vote's all-gather) is launched in :meth:`finish`, again in
    bucket order, never from a future's callback.
    """

    def __init__(
        self,
        config: LowBitConfig | None = None,
        group=None,
        topology: Topology | None = None,
        spec: ShardSpec | None = None,
    ):
        if config is None:  # the default config, imported here: lowbit_strategy.config imports the algorithms
            from lowbit_strategy.config import LowBitConfig

            config = LowBitConfig()
        self.config = config
        if self.config.algorithm != "lion":
            raise ValueError(f"LionCommunicator needs algorithm='lion', got {self.config.algorithm!r}")
        self.group = group  # agreements and momentum sync: every rank
        self.topology = topology if topology is not None and topology.hierarchical else None
        #: which part of each payload this rank sends and how its directions come back
        self.spec: ShardSpec = spec if spec is not None else spec_for(group, self.topology)
        # the compressed collectives: the cross-node group of this local rank, or every rank
        self.sync_group = self.spec.group
        self.world_size = self.spec.world_size  # the workers: N nodes, or P ranks
        lion = lion_section(config)
        if lion.mode in ("sign", "lp") and lion.bits is not None:
            try:  # a lane too narrow for this world size: say so now, not at the first backward
                resolve_mode(config, self.world_size, 1)
            except OverflowError as e:
                raise ConfigError(lion.field_name("bits"), lion.bits, f"at world size {self.world_size}: {e}") from None
        self.traffic = wire.TrafficLog()
        self.plan: SyncMode | None = None
        self.last_audit: dict[str, float] | None = None
        self._flight: InFlight[_LionJob] = InFlight()
        self.codec_seconds: dict[str, float] | None = None
        self.momentum_sync_every: int | None = None
        self.plan_numel: int | None = None

    def calibrate(self, numel: int, momentum_sync_every: int, device: torch.device | str = "cpu") -> None:
        """Before training, on every rank (a collective): measure the codec time of each
        ``auto`` candidate, every rank at once, and keep the slowest rank's figures
        (:func:`~lowbit_strategy.pricing.calibration.agreed_slowest`: ranks sharing cores
        measure as they will run, and a collective waits for its slowest rank), so every rank
        resolves the same plan; and note the optimizer's effective momentum-sync interval."""
        self.momentum_sync_every = momentum_sync_every
        size = min(buckets.bucket_numel(self.config.bucket_size_mb), numel)
        self.plan_numel = size or None  # both paths plan for this size, whatever bucket comes first
        if lion_section(self.config).mode != "auto" or self.world_size == 1 or numel == 0:
            return
        candidates = auto_candidates(self.config, self.world_size, momentum_sync_every)
        p = lion_section(self.config).p
        measure = lambda: measure_codec_seconds(candidates, self.world_size, size, p, device)  # noqa: E731
        self.codec_seconds = agreed_slowest(measure, self.group, "lion.calibrate", self.traffic, device)

    def plan_state(self) -> dict | None:
        """The resolved ``auto`` plan and the world size it is for (checkpoints), or None."""
        if self.plan is None or lion_section(self.config).mode != "auto":
            return None
        return {"world_size": self.world_size, **dataclasses.asdict(self.plan)}

    def restore_plan(self, saved: dict | None) -> None:
        """Keep the ``auto`` plan a checkpoint was saved with (:meth:`plan_state`), at the same
        world size: the plan comes from this machine's codec timing, a measurement, and a
        resumed run measuring anew could choose another mode, so it would not continue as it
        would have. Checked equal on every rank (a collective: every rank calls it)."""
        if lion_section(self.config).mode != "auto" or self.world_size == 1:
            return
        usable = saved if saved is not None and saved.get("world_size") == self.world_size else None
        check_same({"plan": usable}, self.group, "Lion Cub's saved plan")
        if usable is not None:
            self.plan = SyncMode(**{k: v for k, v in usable.items() if k != "world_size"})
            logger.info("lowbit: Lion Cub keeps the plan its checkpoint was saved with: %s", self.plan)

    def _plan(self, step: int, numel: int) -> SyncMode:
        if self.plan is None:
            size = self.plan_numel or min(buckets.bucket_numel(self.config.bucket_size_mb), numel)
            self.plan = resolve_mode(self.config, self.world_size, size, self.codec_seconds, self.momentum_sync_every)
            logger.info(
                "lowbit: Lion Cub synchronizes with %s (codec seconds per bucket: %s)", self.plan, self.codec_seconds
            )
        return self.plan if step > self.config.warmup_steps else EXACT_MODES[self.config.exact_wire]

    # ---- the update direction, at step time --------------------------------------------
    def directions(self, updates: Sequence[torch.Tensor], step: int, audit: bool = False) -> list[torch.Tensor]:
        """sign(Σ_ranks Q(c)) for each update vector ``c`` of this rank (same shapes)."""
        if self.world_size == 1:
            return [torch.sign(c) for c in updates]
        out = [torch.sign(c) for c in updates]  # zero-element ones stay as they are
        synced = [i for i, c in enumerate(updates) if c.numel()]
        if not synced:
            return out
        plan = self._plan(step, sum(updates[i].numel() for i in synced))
        size = buckets.bucket_numel(self.config.bucket_size_mb)
        index = buckets.partition([updates[i].numel() for i in synced], size)
        launched = [self.start([updates[synced[j]] for j in idx], step, plan) for idx in index]
        flats, _ = self.finish(launched, audit)
        for idx, flat, job in zip(index, flats, launched):
            for j, d in zip(idx, buckets.unflatten(flat, job.chunk)):
                out[synced[j]] = d
        return out

    # ---- the update direction, overlapped with backward ----------------------------------
    def launch(
        self,
        params: Sequence[torch.Tensor],
        updates: Sequence[torch.Tensor],
        step: int,
        nonfinite: torch.Tensor,
        key: Hashable | None = None,
    ) -> None:
        """Start the collective of one bucket (called while backward runs): ``updates`` are
        this rank's c for ``params`` (non-empty ones), ``nonfinite`` a device-side bool
        saying whether this rank's gradients in the bucket have NaN/Inf, ``key`` the bucket's
        name (default: its parameters), which a second backward before ``step()`` relaunches.

        Through the shared engine (:class:`~lowbit_strategy.collectives.inflight.InFlight`):
        a stale launch of the bucket is finished and dropped, and the majority vote's second
        collective (the all-gather of the votes, which needs the first one's data) of every
        bucket launched before this one starts now, in launch order, so it overlaps the rest
        of backward instead of waiting for step() (the previous bucket's all-to-all is
        usually done by then: it had a bucket's worth of backward to finish in)."""
        name = key if key is not None else tuple(id(p) for p in params)
        plan = self._plan(step, sum(c.numel() for c in updates))
        start = lambda: self.start(list(updates), step, plan, nonfinite, list(params))  # noqa: E731

        def drop(stale: _LionJob) -> None:
            self.finish([stale])  # its collectives complete on every rank; the result is superseded

        self._flight.launch(name, start, drop)

    def pending(self) -> bool:
        """Whether buckets were launched since the last :meth:`collect`."""
        return self._flight.pending()

    def collect(self, audit: bool = False) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """Finish every launched bucket: ``({id(param): direction}, any rank non-finite)``,
        the verdict a 0-d bool tensor on the device (None when no bucket carried a flag)."""
        launched = self._flight.drain()
        flats, nonfinite = self.finish(launched, audit)
        out: dict[int, torch.Tensor] = {}
        for flat, job in zip(flats, launched):
            for p, d in zip(job.params, buckets.unflatten(flat, job.chunk)):
                out[id(p)] = d
        return out, nonfinite

    # ---- one bucket: encode + launch, then wait + decode ----------------------------------
    def start(
        self, chunk: list, step: int, plan: SyncMode, nonfinite: torch.Tensor | None = None, params: list | None = None
    ) -> _LionJob:
        """Encode one bucket of update vectors and launch its (first) collective over the
        spec's group, on this rank's part of the payload (all of it when flat)."""
        check, traffic, flagged = self.config.debug, self.traffic, nonfinite is not None
        kw: dict[str, Any] = dict(check=check, traffic=traffic)
        group = self.sync_group
        if plan.mode == "lp":
            p = lion_section(self.config).p
            payload = lp_quantize_many(chunk, plan.levels, p)  # each vector its own scale (Eq. 1)
        else:
            payload = buckets.flatten(chunk)
        n = payload.numel()
        lo, hi = self.spec.part(n)
        # an empty part still takes part (one zero element, dropped after): the flag rides along
        payload = pad_empty(payload[lo:hi])
        handle: g.Pending | MajorityVote
        if plan.mode == "1bit":
            flag = nonfinite.to(torch.uint8) if nonfinite is not None else None
            handle = majority_vote_start(payload, step, group, flag=flag, validate=False, **kw)
        elif plan.mode in ("fp32", "bf16"):
            flat = torch.cat([payload, nonfinite.to(payload.dtype).reshape(1)]) if nonfinite is not None else payload
            dtype = torch.float32 if plan.mode == "fp32" else torch.bfloat16
            handle = full_allreduce_start(flat, group, wire_dtype=dtype, **kw)
        elif plan.mode == "sign":
            codes = sign_bits(payload, step, check_nan=False)
            if nonfinite is not None:
                codes = torch.cat([codes, nonfinite.to(torch.uint8).reshape(1)])
            handle = summed_allreduce_start(codes, 1, group, signed=False, lane_bits=plan.bits, validate=False, **kw)
        else:
            codes = torch.cat([payload, nonfinite.to(payload.dtype).reshape(1)]) if nonfinite is not None else payload
            if flagged:
                # NaN/Inf input casts to arbitrary integers: keep them inside their lanes, so
                # that they can never carry into the flag's
                codes[:-1].clamp_(-plan.levels, plan.levels)
            handle = summed_allreduce_start(codes, plan.levels, group, lane_bits=plan.bits, validate=False, **kw)
        directions = _Directions(handle, plan, max(hi - lo, 1), flagged, self.world_size, chunk[0].dtype)
        # the flag covers the whole bucket on every rank that shares it (a node's ranks hold
        # the node's gradient): the spec need not agree it again
        return _LionJob(
            None,
            directions,
            chunk[0].device,
            n,
            64,
            two_phase=plan.mode == "1bit",
            whole_verdict=True,
            flagged=flagged,
            params=params or [],
            chunk=chunk,
        )

    def finish(
        self, launched: Sequence[_LionJob], audit: bool = False
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Wait for launched buckets (:func:`~lowbit_strategy.collectives.inflight.finish`:
        second collectives launched first, in order; each part's directions restored to the
        whole bucket through the spec): their flat directions, and whether any rank flagged a
        non-finite gradient, as a 0-d bool tensor on the device (None when no bucket carried
        a flag; no host read here)."""
        flats, bad = finish(launched, self.spec, self.traffic)
        # the audit (a diagnostic, on request) reads the verdict and its counts on the host
        if audit and (bad is None or not bool(bad)):
            audits = [self._audit(job.chunk, flat) for job, flat in zip(launched, flats)]
            total = sum(a[2] for a in audits)
            self.last_audit = {
                "sign_match": sum(a[0] for a in audits) / total,
                "sign_flip": sum(a[1] for a in audits) / total,
            }
        return flats, bad

    def _audit(self, chunk: Sequence[torch.Tensor], direction: torch.Tensor) -> tuple[float, float, int]:
        """Compare with the full-precision direction (Lion Cub Fig. 4): (#match, #flip, #total)."""
        exact = torch.sign(full_allreduce(buckets.flatten(chunk), self.group, traffic=wire.TrafficLog()))
        match = int((direction == exact).sum())
        flip = int(((direction == -exact) & (exact != 0)).sum())
        return match, flip, exact.numel()

    # ---- agreement and momentum --------------------------------------------------------
    def agree(
        self, has_grad: Sequence[bool], nonfinite: torch.Tensor | bool | None, device: torch.device | str = "cpu"
    ) -> tuple[list[bool], bool]:
        """Which parameters have a gradient on *any* rank, and whether any rank saw NaN/Inf
        (:func:`lowbit_strategy.collectives.agreement.agree`)."""
        return agree(has_grad, nonfinite, self.group, "lion.agree", self.traffic, device)

    def average_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replace each tensor by its mean over the workers (fp32 on the wire), in place.

        Across nodes the node is the worker and its ranks hold the same momenta: each local
        rank averages its shard over its cross-node group (N workers) and the node
        all-gathers the shards, so the result is the mean over nodes — the flat form's at N
        workers — and a node's link carries the momenta once, not L times."""
        tensors = [t for t in tensors if t.numel()]
        if self.world_size == 1 or not tensors:
            return
        flat = buckets.flatten(tensors).float()
        n = flat.numel()
        part = take(self.spec, flat)  # an empty part still takes part
        part = full_allreduce(part, self.sync_group, traffic=self.traffic) / self.world_size
        mean, _ = self.spec.restore_async(part, n, self.traffic).wait()
        for t, v in zip(tensors, buckets.unflatten(mean, tensors)):
            t.copy_(v)
