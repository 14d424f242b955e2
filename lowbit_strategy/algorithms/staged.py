"""Two-stage optimizers with a compressed momentum: the parts 1-bit Adam / 1-bit LAMB and
TurboQuant-Adam share.

Both papers train in two stages. **Warm-up**: the plain optimizer on gradients averaged in
full precision (the DDP hook averages them exactly as DDP does). **Compression**: gradients
stay local; each rank forms its momentum from its own gradient, ``m_i = β1·m + (1-β1)·g_i``,
and a compressed collective returns the mean of the ``m_i`` (the same on every rank); the
optimizer then applies its update. What differs is the collective (error-compensated
1-bit signs; Hadamard + Lloyd–Max codes) and the update (frozen or live variance), which
the subclasses and their communicators supply. Shared here:

* :class:`StagedOptimizer`: the stage switch, the fixed bucket layout of the fused momentum
  buffers, the overlap entry from the DDP hook (:meth:`~StagedOptimizer.grads_ready`), the
  NaN/Inf rule (a step non-finite on any rank is skipped on every rank, state untouched);
* :class:`BucketCommunicator`: one compressed collective per bucket, started from the hook
  or at ``step()``, the defer-one rule, and rank-local per-bucket state (error buffers,
  scales) committed only when the step is applied;
* :class:`StagedSync`: the algorithm-interface side (the hook: mean allreduce during
  warm-up, local gradients + overlap afterwards; attach; per-rank checkpoints).

Everything reads ``group["lr"]`` at every step, so LR schedulers work.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch.optim import Optimizer

from lowbit_strategy import buckets
from lowbit_strategy.algorithms.base import LowBitSetupError, Sync
from lowbit_strategy.algorithms.onebit import update as U
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives import wire
from lowbit_strategy.rank_state import to_cpu

logger = logging.getLogger(__name__)

#: a bucket of the optimizer's layout: the indices of its parameters in ``param_groups`` order
Key = tuple[int, ...]


def check_number(cls: str, name: str, value, low: float, high: float | None = None, low_open: bool = False) -> float:
    """``value`` as a float; ``ValueError`` naming ``cls`` and ``name`` unless it lies in the range."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    ok = ok and (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        span = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'})"
        raise ValueError(f"{cls}: {name} must be a number in {span}, got {value!r}")
    return float(value)


# ---- the communicator ------------------------------------------------------------------


@dataclass
class Job:
    """One bucket's collective in flight."""

    key: Key
    like: list               # the momenta sent (shapes and dtypes of the results)
    state: tuple             # this step's rank-local state of the bucket, committed on success
    handle: object           # .gather() -> .wait() -> the flat mean


class BucketCommunicator:
    """Process group + per-bucket rank-local state: the mean over ranks of each bucket's
    momenta through a compressed collective (subclasses: :meth:`_start_bucket`,
    :meth:`_non_finite`).

    Two ways in, with the same result bit for bit: :meth:`launch` from the DDP hook, one
    bucket at a time as backward makes its gradients ready, then :meth:`collect` in
    ``step()``; or :meth:`synchronize` in ``step()``. Buckets are the optimizer's own fixed
    layout (not DDP's, which DDP rebuilds after its first iteration): a compressed result
    depends on which elements share a scale, so a fixed layout keeps overlap on and off,
    and a resumed run, bit for bit the same. A step's new state is only committed
    (:meth:`commit`) once the optimizer applies the step; a skipped step keeps the old one
    (:meth:`discard`).
    """

    #: name used in log messages
    label = "compressed"

    def __init__(self, group=None, bucket_size_mb: float = 25.0, debug: bool = False):
        self.group = group
        self.world_size = g.world_size(group)
        #: elements per bucket of the optimizer's fixed layout
        self.bucket_numel = buckets.bucket_numel(bucket_size_mb)
        self.debug = debug
        self.traffic = wire.TrafficLog()
        #: per bucket: the committed rank-local state (a tuple of tensors)
        self.errors: dict[Key, tuple] = {}
        self._inflight: dict[Key, Job] = {}
        self._finished: list[Job] = []

    # ---- subclass hooks ----------------------------------------------------------------
    def _start_bucket(self, key: Key, flat: torch.Tensor, saved: tuple | None) -> tuple[tuple, object]:
        """Start the collective of one bucket's flat float32 momenta (``flat`` may be used as
        the output buffer). ``saved``: the bucket's committed state, or None (a new bucket):
        returns ``(this step's state, handle)``; never modify ``saved`` in place."""
        raise NotImplementedError

    def _non_finite(self, job: Job) -> bool:
        """After the wait: whether any rank's input to this bucket was non-finite (the same
        verdict on every rank)."""
        raise NotImplementedError

    # ---- one bucket ----------------------------------------------------------------
    def _start(self, key: Key, momenta: Sequence[torch.Tensor]) -> Job:
        flat = buckets.flatten([m.float() for m in momenta])
        saved = self.errors.get(key)
        if saved is not None and (saved[0].numel() != flat.numel() or saved[0].device != flat.device):
            saved = None
        if saved is None and self.errors:
            logger.info("lowbit: %s bucket %s is new (bucket layout changed); its state starts afresh", self.label,
                        key[:4] + ((...,) if len(key) > 4 else ()))
        state, handle = self._start_bucket(key, flat, saved)
        return Job(key, list(momenta), state, handle)

    def _finish(self, jobs: Sequence[Job]) -> tuple[list[list[torch.Tensor]], bool]:
        pending = [job.handle.gather() for job in jobs]  # second phases launched first, in order
        results, bad = [], False
        for job, handle in zip(jobs, pending):
            flat = handle.wait()
            bad = bad or self._non_finite(job)
            results.append(buckets.unflatten(flat.view(-1), job.like))
        self._finished.extend(jobs)
        return results, bad

    # ---- overlapped with backward --------------------------------------------------
    def launch(self, key: Key, momenta: Sequence[torch.Tensor]) -> None:
        """Start one bucket's collective (from the communication hook)."""
        stale = self._inflight.pop(key, None)
        if stale is not None:  # a second backward before step(): its result is superseded
            self._finish([stale])
            self._finished.remove(stale)
        # Defer-one rule: start the second phase of the buckets launched before this one, in
        # launch order (the same on every rank), so it overlaps the rest of backward.
        for job in self._inflight.values():
            job.handle.gather()
        self._inflight[key] = self._start(key, momenta)

    def pending(self) -> bool:
        return bool(self._inflight)

    def collect(self) -> tuple[dict[Key, list[torch.Tensor]], bool]:
        """Finish every launched bucket: ``({key: mean momenta}, any rank non-finite)``."""
        jobs, self._inflight = list(self._inflight.values()), {}
        results, bad = self._finish(jobs)
        return {job.key: r for job, r in zip(jobs, results)}, bad

    # ---- at step time ----------------------------------------------------------------
    def synchronize(self, jobs: Sequence[tuple[Key, Sequence[torch.Tensor]]]) -> tuple[list[list[torch.Tensor]], bool]:
        """Mean momenta of each ``(key, momenta)`` bucket, in the order given:
        ``(results per bucket, any rank non-finite)``."""
        return self._finish([self._start(key, momenta) for key, momenta in jobs])

    def commit(self) -> None:
        """The step was applied: this step's per-bucket state becomes the state."""
        for job in self._finished:
            self.errors[job.key] = job.state
        self._finished = []

    def discard(self) -> None:
        """The step was skipped: keep the previous state."""
        self._finished = []

    # ---- rank-local state --------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"world_size": self.world_size,
                "errors": {",".join(map(str, k)): tuple(t.detach().cpu().clone() for t in v)
                           for k, v in self.errors.items()}}

    def load_state_dict(self, state: dict, device) -> None:
        if state.get("world_size", self.world_size) != self.world_size:
            logger.warning("lowbit: %s state was saved at world size %s, running %d: it starts afresh",
                           self.label, state.get("world_size"), self.world_size)
            self.errors = {}
            return
        self.errors = {tuple(int(i) for i in k.split(",")): tuple(t.to(device) for t in v)
                       for k, v in state.get("errors", {}).items()}


# ---- the optimizer ------------------------------------------------------------------------


class StagedOptimizer(Optimizer):
    """Warm-up, then compressed momenta: the stage switch, the communicator wiring and the
    safety rules. Subclasses supply :meth:`_warmup` and :meth:`_compressed` (per-parameter
    arithmetic) and may override :meth:`_local_momentum` and :meth:`_end_warmup`.

    ``warmup``: steps of the first stage (``warmup_name`` is how the subclass calls it in
    its signature and errors); ``step_key``: the ``param_groups`` entry counting applied
    steps (it travels in the optimizer's state dict).
    """

    def __init__(self, params: Iterable, defaults: dict, warmup: int, warmup_name: str, step_key: str,
                 min_warmup: int = 1):
        name = type(self).__name__
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < min_warmup:
            raise ValueError(f"{name}: {warmup_name} must be an int >= {min_warmup} (full-precision steps before "
                             f"compression), got {warmup!r}")
        betas = defaults["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{name}: betas must be a pair (beta1, beta2), got {betas!r}")
        check_number(name, "lr", defaults["lr"], 0.0)
        check_number(name, "betas[0]", betas[0], 0.0, 1.0)
        check_number(name, "betas[1]", betas[1], 0.0, 1.0)
        check_number(name, "eps", defaults["eps"], 0.0, low_open=True)
        check_number(name, "weight_decay", defaults["weight_decay"], 0.0)
        super().__init__(params, {**defaults, "betas": tuple(betas)})
        self._warmup_steps = warmup
        self._step_key = step_key
        self.skipped_steps = 0
        self.attach_communicator(None)

    # ---- stage ---------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        """Optimizer steps taken (skipped ones not counted)."""
        return max((grp.get(self._step_key, 0) for grp in self.param_groups), default=0)

    @property
    def stage(self) -> str:
        """``"warmup"`` or ``"compression"``: the stage of the *next* step."""
        return "warmup" if self.global_step < self._warmup_steps else "compression"

    def attach_communicator(self, communicator: Optional[BucketCommunicator]) -> None:
        """Make this optimizer distributed (or single-process again with None)."""
        self.communicator = communicator
        self._layout = None
        self._ready: set[int] = set()
        self._launched: set[Key] = set()

    @property
    def _distributed(self) -> bool:
        return self.communicator is not None and self.communicator.world_size > 1

    def _params(self) -> list[torch.Tensor]:
        return [p for grp in self.param_groups for p in grp["params"]]

    def _group_of(self) -> dict[int, dict]:
        return {id(p): grp for grp in self.param_groups for p in grp["params"]}

    def layout(self) -> list[Key]:
        """The fused momentum buffers: parameter indices (in ``param_groups`` order), last
        parameter first — the order backward produces gradients — cut into buckets of the
        config's ``bucket_size_mb``. Fixed for the optimizer's life, on every rank: each
        bucket's compressed result depends on which elements share its scale."""
        if self._layout is None:
            # (parameter, its group) by index and index by id: built once, read by every hook call
            self._slots = [(p, grp) for grp in self.param_groups for p in grp["params"]]
            self._index_of = {id(p): i for i, (p, _) in enumerate(self._slots)}
            order = [i for i in reversed(range(len(self._slots))) if self._slots[i][0].requires_grad
                     and self._slots[i][0].numel()]
            numels = [self._slots[i][0].numel() for i in order]
            self._layout = [tuple(order[j] for j in idx) for idx in buckets.plan(numels, self.communicator.bucket_numel)]
        return self._layout

    # ---- the DDP hook's entry (compression stage, overlap) ---------------------------------
    @torch.no_grad()
    def grads_ready(self, params: list) -> None:
        """Some parameters' local gradients are final (called from the communication hook
        during backward): start the collective of every layout bucket whose gradients are
        now all ready (DDP calls the hook in the same order on every rank, so every rank
        starts the same buckets in the same order); :meth:`step` finishes them and
        synchronizes the rest."""
        layout = self.layout()
        now = {self._index_of[id(p)] for p in params if id(p) in self._index_of}
        if now & self._ready:  # a second backward before step(): its gradients supersede the first's
            self._ready, self._launched = set(), set()
        self._ready |= now
        for key in layout:  # layout order: the same on every rank
            if key not in self._launched and all(i in self._ready for i in key):
                self._launched.add(key)
                self.communicator.launch(key, self._momenta(key))

    def _momenta(self, key: Key) -> list[torch.Tensor]:
        out = []
        for i in key:
            p, group = self._slots[i]
            grad = p.grad if p.grad is not None else torch.zeros_like(p)  # unused here: a zero gradient
            out.append(self._local_momentum(group, p, grad))
        return out

    def _local_momentum(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """β1·m + (1-β1)·g_i for this rank's gradient, in a new tensor."""
        return self._state(p)["exp_avg"].lerp(grad.view_as(p), 1 - group["betas"][0])

    # ---- step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.global_step + 1
        applied = self._warmup_step(step) if step <= self._warmup_steps else self._compressed_step(step)
        if applied:
            for group in self.param_groups:
                group[self._step_key] = step
            if step == self._warmup_steps:
                self._end_warmup()
        return loss

    def _skip(self) -> bool:
        self.skipped_steps += 1
        warnings.warn(f"{type(self).__name__}: non-finite gradient (NaN/Inf) on at least one rank; step skipped on "
                      "every rank, weights, moments and error buffers unchanged", RuntimeWarning, stacklevel=3)
        return False

    def _check_dense(self, params) -> None:
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients; use dense embeddings")

    def _warmup_step(self, step: int) -> bool:
        """The plain optimizer on the (hook-averaged, hence identical) gradients; parameters
        without a gradient are skipped, as torch's optimizers do."""
        active = [(grp, p) for grp in self.param_groups for p in grp["params"] if p.grad is not None]
        self._check_dense(p for _, p in active)
        if active and bool(torch.stack([~torch.isfinite(p.grad).all() for _, p in active]).any()):
            return self._skip()
        for grp, p in active:
            self._warmup(grp, p, p.grad, step)
        return bool(active)

    def _compressed_step(self, step: int) -> bool:
        """The compression stage for every parameter of the layout: its mean momentum
        through the communicator (a parameter without a gradient counts as a zero gradient:
        the fused buffer always holds every parameter), then the update. One process: the
        exact momentum (nothing to send)."""
        params, group_of = self._params(), self._group_of()
        self._check_dense(params)
        if not self._distributed:
            grads = [p.grad for p in params if p.grad is not None]
            if grads and bool(torch.stack([~torch.isfinite(gr).all() for gr in grads]).any()):
                return self._skip()
            means = {i: self._local_momentum(group_of[id(p)], p, p.grad) for i, p in enumerate(params)
                     if p.grad is not None}
        else:
            comm = self.communicator
            layout = self.layout()
            by_key, bad = comm.collect() if comm.pending() else ({}, False)
            rest = [key for key in layout if key not in by_key]
            results, bad_rest = comm.synchronize([(key, self._momenta(key)) for key in rest])
            by_key.update(zip(rest, results))
            self._ready, self._launched = set(), set()
            if bad or bad_rest:
                comm.discard()
                return self._skip()
            comm.commit()
            means = {i: m for key, ms in by_key.items() for i, m in zip(key, ms)}
        for i, mean in means.items():
            self._compressed(group_of[id(params[i])], params[i], mean, step)
        return bool(means)

    # ---- per-parameter arithmetic (subclasses) ---------------------------------------------
    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _warmup(self, group: dict, p: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        """One warm-up step: ``torch.optim.AdamW`` bit for bit (1-bit LAMB overrides it with LAMB)."""
        state = self._state(p)
        beta1, beta2 = group["betas"]
        U.adamw_(p, grad, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"], beta1=beta1, beta2=beta2,
                 eps=group["eps"], weight_decay=group["weight_decay"], step=step)

    def _compressed(self, group: dict, p: torch.Tensor, mean: torch.Tensor, step: int) -> None:
        raise NotImplementedError

    def _end_warmup(self) -> None:
        """Called once, at the end of the last warm-up step."""

    # ---- diagnostics (callbacks.DivergenceMonitor) -------------------------------------------
    def divergence_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, tensor)`` pairs whose spread across ranks shows how far the ranks' views
        differ: in the compression stage the local part of the momentum each rank sends,
        (1-β1)·g_i (the β1·m part is the same everywhere); nothing during warm-up, when
        gradients are averaged before the step."""
        if self.global_step <= self._warmup_steps:
            return []
        return [(p, p.grad * (1 - grp["betas"][0])) for grp in self.param_groups for p in grp["params"]
                if p.grad is not None and p.numel()]


# ---- the algorithm-interface side -------------------------------------------------------


def _mean_allreduce(buf: torch.Tensor, group, traffic) -> torch.futures.Future:
    """DDP's own averaging of a bucket, bit for bit: scale by 1/P (a multiply, as DDP's
    reducer does), then a SUM allreduce."""
    buf.mul_(1.0 / g.world_size(group))
    return g.all_reduce_sum_async(buf, group, "staged.warmup.allreduce", traffic)


class StagedSync(Sync):
    """One optimizer-level :class:`~.base.Sync` for every :class:`StagedOptimizer`.

    The DDP hook does what the optimizer's stage needs: during warm-up it averages the bucket
    in full precision exactly as DDP does; in the compression stage it keeps the gradients
    local and, with ``overlap``, tells the optimizer which gradients are ready, so the
    optimizer starts the collective of every complete bucket of its own layout while
    backward goes on. Rank-local state in checkpoints: each optimizer's ``state`` and its
    communicator's per-bucket state. Subclasses set :attr:`optimizer_class`,
    :attr:`algorithm_name` and implement :meth:`make_communicator`.
    """

    level = "optimizer"
    #: the optimizer class this algorithm drives
    optimizer_class: type = StagedOptimizer
    algorithm_name = ""
    #: how the optimizer's arguments are described in the wrong-optimizer error
    arguments_hint = ""

    def __init__(self, config, module: torch.nn.Module, group=None):
        super().__init__(config, group)
        self.section = getattr(config, self.algorithm_name)
        self.overlap = self.section.overlap
        self.optimizers: list[StagedOptimizer] = []
        self._owner: dict[int, StagedOptimizer] = {}
        self._hook_traffic = wire.TrafficLog()

    def make_communicator(self, optimizer: StagedOptimizer) -> BucketCommunicator:
        raise NotImplementedError

    def bucket_ready(self, bucket):
        params = bucket.parameters()
        owners = [opt for opt in self.optimizers if any(self._owner.get(id(p)) is opt for p in params)]
        if any(opt.stage == "warmup" for opt in owners) or not owners:
            return _mean_allreduce(bucket.buffer(), self.group, self._hook_traffic)
        if self.overlap:
            for opt in owners:  # the same order on every rank
                if opt._distributed:
                    opt.grads_ready([p for p in params if self._owner.get(id(p)) is opt])
        return super().bucket_ready(bucket)

    def disable_overlap(self, reason: str) -> None:
        if self.overlap:
            logger.info("lowbit: %s synchronizes momenta in optimizer.step(), not during backward: %s "
                        "(during warm-up gradients are averaged during backward either way)",
                        self.optimizer_class.__name__, reason)
        self.overlap = False

    def attach(self, optimizers: Sequence[torch.optim.Optimizer], who: str = "") -> None:
        cls = self.optimizer_class
        for opt in optimizers:
            if type(opt) is not cls:
                raise LowBitSetupError(
                    f"{who or f'LowBitConfig(algorithm={self.algorithm_name})'} drives lowbit_strategy.{cls.__name__}, "
                    f"but got {type(opt).__module__}.{type(opt).__name__}. Use lowbit_strategy.{cls.__name__}(...)"
                    f"{self.arguments_hint}, or plain DDP / algorithm='bitdp' for other optimizers."
                )
        self.optimizers = list(optimizers)
        self._owner = {id(p): opt for opt in self.optimizers for grp in opt.param_groups for p in grp["params"]}
        for opt in self.optimizers:
            opt.attach_communicator(self.make_communicator(opt))

    def detach(self) -> None:
        self._owner = {}
        for opt in self.optimizers:
            opt.attach_communicator(None)

    def traffic_logs(self) -> list[wire.TrafficLog]:
        return [self._hook_traffic] + [opt.communicator.traffic for opt in self.optimizers
                                       if opt.communicator is not None]

    def state_dict(self) -> dict:
        return {"optimizers": [{"state": to_cpu(opt.state_dict()["state"]),
                                "errors": opt.communicator.state_dict() if opt.communicator else {}}
                               for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("optimizers", [])
        if len(saved) != len(self.optimizers):
            raise ValueError(f"{self.optimizer_class.__name__} state holds {len(saved)} optimizers, the run has "
                             f"{len(self.optimizers)}")
        for opt, own in zip(self.optimizers, saved):
            opt.load_state_dict({**opt.state_dict(), "state": own["state"]})
            if opt.communicator is not None:
                device = next((p.device for grp in opt.param_groups for p in grp["params"]), "cpu")
                opt.communicator.load_state_dict(own.get("errors") or {}, device)


def check_local_gradient_precision(precision: Optional[str]) -> None:
    """Refuse ``16-mixed``: in the compression stage gradients stay local, so each rank's
    GradScaler could skip a different step and the ranks would hang."""
    if precision == "16-mixed":
        raise LowBitSetupError(
            "Optimizers that keep gradients local (1-bit Adam/LAMB, TurboQuantAdamW) do not support "
            "precision='16-mixed': each rank's GradScaler could skip a different step and the ranks would hang. "
            "Use precision='bf16-mixed' or '32-true' (the optimizers skip non-finite steps on all ranks together)."
        )


def rank0_state_without_errors(states: list[dict]) -> dict:
    """Another world size: the optimizer state of rank 0 and no per-bucket communicator state
    (it describes chunks of the old world size; error feedback restarts from 0)."""
    return {"optimizers": [{"state": own["state"], "errors": {}} for own in states[0]["optimizers"]]}
