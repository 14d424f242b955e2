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
see :func:`~.plan.resolve_mode`. The first ``warmup_steps`` steps synchronize the exact fp32
sum. With one rank nothing is sent and the direction is sign(c), so a world of one is
plain Lion bit for bit. Zero-element tensors take no part in any collective (their
direction is the empty tensor).

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

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch

from lowbit_strategy import buckets
from lowbit_strategy.algorithms.lion_cub.plan import (
    WARMUP_PLAN,
    Plan,
    _lion,
    auto_candidates,
    measure_codec_seconds,
    resolve_mode,
)
from lowbit_strategy.codecs import lp_quantize_levels, sign_bits
from lowbit_strategy.collectives import full_allreduce, wire
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.agreement import agree
from lowbit_strategy.collectives.calibration import agreed_slowest
from lowbit_strategy.collectives.hierarchy import Topology
from lowbit_strategy.collectives.majority import MajorityVote, majority_vote_start
from lowbit_strategy.collectives.reference import full_allreduce_start
from lowbit_strategy.collectives.streams import SideStream
from lowbit_strategy.collectives.summed import summed_allreduce_start
from lowbit_strategy.validation import ConfigError

if TYPE_CHECKING:  # the config reads the registry, which imports this module: annotations only
    from lowbit_strategy.config import LowBitConfig

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """One bucket's collective, launched; finished by :meth:`LionCommunicator.finish`."""

    params: list  # the parameters the bucket covers (overlap path), else empty
    chunk: list  # this rank's update vectors c, in bucket order
    plan: Plan
    handle: g.Pending | MajorityVote  # MajorityVote for the 1bit plan
    flagged: bool  # a non-finite flag travels with the payload
    n: int  # the bucket's elements
    sent: int  # how many of them this rank's collective carries (its shard; all when flat)

    @property
    def vote(self) -> MajorityVote:
        """The handle of a ``1bit`` bucket: its majority vote."""
        return cast(MajorityVote, self.handle)


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

    def __init__(self, config: LowBitConfig | None = None, group=None, topology: Topology | None = None):
        if config is None:  # the default config, imported here: lowbit_strategy.config imports the algorithms
            from lowbit_strategy.config import LowBitConfig

            config = LowBitConfig()
        self.config = config
        if self.config.algorithm != "lion":
            raise ValueError(f"LionCommunicator needs algorithm='lion', got {self.config.algorithm!r}")
        self.group = group  # agreements and momentum sync: every rank
        self.topology = topology if topology is not None and topology.hierarchical else None
        # the compressed collectives: the cross-node group of this local rank, or every rank
        self.sync_group = self.topology.inter if self.topology else group
        self.world_size = g.world_size(self.sync_group)  # the workers: N nodes, or P ranks
        lion = _lion(config)
        if lion.mode in ("sign", "lp") and lion.bits is not None:
            try:  # a lane too narrow for this world size: say so now, not at the first backward
                resolve_mode(config, self.world_size, 1)
            except OverflowError as e:
                raise ConfigError(lion.field_name("bits"), lion.bits, f"at world size {self.world_size}: {e}") from None
        self.traffic = wire.TrafficLog()
        self._side = SideStream()
        self.plan: Plan | None = None
        self.last_audit: dict[str, float] | None = None
        self._inflight: dict[tuple[int, ...], _InFlight] = {}
        self.codec_seconds: dict[str, float] | None = None
        self.momentum_sync_every: int | None = None
        self.plan_numel: int | None = None

    def calibrate(self, numel: int, momentum_sync_every: int, device: torch.device | str = "cpu") -> None:
        """Before training, on every rank (a collective): measure the codec time of each
        ``auto`` candidate, every rank at once, and keep the slowest rank's figures
        (:func:`~lowbit_strategy.collectives.calibration.agreed_slowest`: ranks sharing cores
        measure as they will run, and a collective waits for its slowest rank), so every rank
        resolves the same plan; and note the optimizer's effective momentum-sync interval."""
        self.momentum_sync_every = momentum_sync_every
        size = min(buckets.bucket_numel(self.config.bucket_size_mb), numel)
        self.plan_numel = size or None  # both paths plan for this size, whatever bucket comes first
        if _lion(self.config).mode != "auto" or self.world_size == 1 or numel == 0:
            return
        candidates = auto_candidates(self.config, self.world_size, momentum_sync_every)
        p = _lion(self.config).p
        measure = lambda: measure_codec_seconds(candidates, self.world_size, size, p, device)  # noqa: E731
        self.codec_seconds = agreed_slowest(measure, self.group, "lion.calibrate", self.traffic, device)

    def _plan(self, step: int, numel: int) -> Plan:
        if self.plan is None:
            size = self.plan_numel or min(buckets.bucket_numel(self.config.bucket_size_mb), numel)
            self.plan = resolve_mode(self.config, self.world_size, size, self.codec_seconds, self.momentum_sync_every)
            logger.info(
                "lowbit: Lion Cub synchronizes with %s (codec seconds per bucket: %s)", self.plan, self.codec_seconds
            )
        return self.plan if step > self.config.warmup_steps else WARMUP_PLAN

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
        index = buckets.plan([updates[i].numel() for i in synced], size)
        launched = [self.start([updates[synced[j]] for j in idx], step, plan) for idx in index]
        flats, _ = self.finish(launched, audit)
        for idx, flat, job in zip(index, flats, launched):
            for j, d in zip(idx, buckets.unflatten(flat, job.chunk)):
                out[synced[j]] = d
        return out

    # ---- the update direction, overlapped with backward ----------------------------------
    def launch(
        self, params: Sequence[torch.Tensor], updates: Sequence[torch.Tensor], step: int, nonfinite: torch.Tensor
    ) -> None:
        """Start the collective of one DDP bucket (called from the communication hook):
        ``updates`` are this rank's c for ``params`` (non-empty ones), ``nonfinite`` a
        device-side bool saying whether this rank's gradients in the bucket have NaN/Inf."""
        key = tuple(id(p) for p in params)
        stale = self._inflight.pop(key, None)
        if stale is not None:  # a second backward before step() (accumulation without no_sync)
            self.finish([stale])
        # Defer-one rule: the majority vote's second collective (the all-gather of the votes)
        # needs the first one's data. Every bucket's hook first starts the second phase of
        # the buckets launched before it, in launch order, so it overlaps the rest of
        # backward instead of waiting for step(); the order of collectives stays the same
        # on every rank (the previous bucket's all-to-all is usually done by then: it had
        # a bucket's worth of backward to finish in).
        for job in self._inflight.values():  # (on CUDA on a side stream: backward does not wait for it)
            if job.plan.mode == "1bit":
                self._side.run(job.chunk[0].device, job.vote, job.vote.gather)
        plan = self._plan(step, sum(c.numel() for c in updates))
        self._inflight[key] = self.start(list(updates), step, plan, nonfinite, list(params))

    def pending(self) -> bool:
        """Whether buckets were launched since the last :meth:`collect`."""
        return bool(self._inflight)

    def collect(self, audit: bool = False) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """Finish every launched bucket: ``({id(param): direction}, any rank non-finite)``,
        the verdict a 0-d bool tensor on the device (None when no bucket carried a flag)."""
        launched, self._inflight = list(self._inflight.values()), {}
        for device in {job.chunk[0].device for job in launched}:
            self._side.join(device)  # second phases started from the hook, on CUDA's side stream
        flats, nonfinite = self.finish(launched, audit)
        out: dict[int, torch.Tensor] = {}
        for flat, job in zip(flats, launched):
            for p, d in zip(job.params, buckets.unflatten(flat, job.chunk)):
                out[id(p)] = d
        return out, nonfinite

    # ---- one bucket: encode + launch, then wait + decode ----------------------------------
    def start(
        self, chunk: list, step: int, plan: Plan, nonfinite: torch.Tensor | None = None, params: list | None = None
    ) -> _InFlight:
        """Encode one bucket of update vectors and launch its (first) collective: over all
        ranks, or across nodes on this local rank's shard of the payload."""
        check, traffic, flagged = self.config.debug, self.traffic, nonfinite is not None
        kw: dict[str, Any] = dict(check=check, traffic=traffic)
        group = self.sync_group
        if plan.mode == "lp":
            p = _lion(self.config).p
            payload = torch.cat([lp_quantize_levels(c.reshape(-1), plan.levels, p, validate=False) for c in chunk])
        else:
            payload = buckets.flatten(chunk)
        n = sent = payload.numel()
        if self.topology is not None:
            lo, hi = self.topology.shard(n)
            sent = hi - lo
            # an empty shard still takes part (one zero element, dropped after): the flag rides along
            payload = payload[lo:hi] if sent else payload.new_zeros(1)
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
        return _InFlight(params or [], chunk, plan, handle, flagged, n, sent)

    def finish(
        self, launched: Sequence[_InFlight], audit: bool = False
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Wait for launched buckets (second collectives launched first, in order): their
        flat directions, and whether any rank flagged a non-finite gradient, as a 0-d bool
        tensor on the device (None when no bucket carried a flag; no host read here)."""
        handles = [job.vote.gather() if job.plan.mode == "1bit" else job.handle for job in launched]
        flats, verdicts = [], []
        for job, handle in zip(launched, handles):
            result = handle.wait()
            n = max(job.sent, 1) if self.topology is not None else job.n  # where a flag follows
            if job.plan.mode == "1bit":
                flat = result
                if job.flagged:
                    flags = job.vote.flags  # every rank's flag, set by gather()
                    if flags is None:
                        raise RuntimeError("a flagged majority vote has no flags after its all-to-all")
                    verdicts.append(flags.sum() > 0)
            else:
                if job.flagged:
                    verdicts.append(result[n] > 0)
                result = result[:n]
                if job.plan.mode == "sign":
                    result = 2 * result - self.world_size
                flat = torch.sign(result).to(job.chunk[0].dtype)
            if self.topology is not None:  # this shard's directions -> the node's whole bucket
                flat = self.topology.gather_async(flat[: job.sent], job.n, self.traffic).wait()[0]
            flats.append(flat)
        bad = torch.stack(verdicts).any() if verdicts else None
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
        if self.topology is None:
            mean = full_allreduce(flat, self.group, traffic=self.traffic) / self.world_size
        else:
            n = flat.numel()
            lo, hi = self.topology.shard(n)
            part = flat[lo:hi] if hi > lo else flat.new_zeros(1)  # an empty shard still takes part
            part = full_allreduce(part, self.sync_group, traffic=self.traffic) / self.world_size
            mean, _ = self.topology.gather_async(part[: hi - lo], n, self.traffic).wait()
        for t, v in zip(tensors, buckets.unflatten(mean, tensors)):
            t.copy_(v)
