"""The staged optimizers' base class: warm-up, then compressed momenta (the stage switch,
the fixed bucket layout, the overlap entry from the DDP hook, the NaN/Inf rule;
:mod:`lowbit_strategy.algorithms.staged`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import cast

import torch
from torch.optim import Optimizer

from lowbit_strategy.algorithms.staged import adam
from lowbit_strategy.algorithms.staged.agreement import ALARM, SKIP, RankAgreement, any_nonfinite, verdict_level
from lowbit_strategy.algorithms.staged.communicator import BucketCommunicator, Formed
from lowbit_strategy.layout import Key, Layout, is_dtensor, local_step
from lowbit_strategy.validation import check_int, check_number


class StagedOptimizer(RankAgreement, Optimizer):
    """Warm-up, then compressed momenta: the stage switch, the communicator wiring and the
    safety rules. Subclasses supply :meth:`_warmup` and :meth:`_compressed` (per-parameter
    arithmetic) and may override :meth:`_local_momentum` and :meth:`_end_warmup`.

    ``warmup``: steps of the first stage (``warmup_name`` is how the subclass calls it in
    its signature and errors); ``step_key``: the ``param_groups`` entry counting applied
    steps (it travels in the optimizer's state dict).
    """

    def __init__(
        self, params: Iterable, defaults: dict, warmup: int, warmup_name: str, step_key: str, min_warmup: int = 1
    ):
        name = type(self).__name__
        check_int(name, warmup_name, warmup, min_warmup, what=" (full-precision steps before compression)")
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
        #: a device-side flag the last compressed update raised (a subclass's guard): read with
        #: the next step's verdict, in the step's one host read (:meth:`_raise_alarm`)
        self._alarm: torch.Tensor | None = None
        #: inside a step on DTensor parameters (:func:`~lowbit_strategy.layout.local_step`): local tensor -> parameter
        self._global_of: dict[int, torch.Tensor] = {}
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

    def attach_communicator(
        self, communicator: BucketCommunicator | None, names: Mapping[int, str] | None = None
    ) -> None:
        """Make this optimizer distributed (or single-process again with None). Its
        :class:`~lowbit_strategy.layout.Layout` (slots, fixed buckets, parameter ``names``
        for checkpoints: ``id(param) -> name``) is built here, once, from the local tensors."""
        self.communicator = communicator
        self.param_layout: Layout | None = None
        if communicator is not None:
            self.param_layout = Layout(self.param_groups, communicator.bucket_numel, names)
            communicator.layout = self.param_layout
        self._ready: set[int] = set()
        self._launched: set[Key] = set()

    @property
    def _distributed(self) -> bool:
        return self.communicator is not None and self.communicator.world_size > 1

    def _attached(self) -> BucketCommunicator:
        """The communicator, which the distributed paths (the layout, the hook, the compressed
        step with several ranks) need."""
        if self.communicator is None:
            raise RuntimeError(f"{type(self).__name__}: no communicator attached (see attach_communicator)")
        return self.communicator

    def _params(self) -> list[torch.Tensor]:
        return [p for grp in self.param_groups for p in grp["params"]]

    def _group_of(self) -> dict[int, dict]:
        return {id(p): grp for grp in self.param_groups for p in grp["params"]}

    def layout(self) -> list[Key]:
        """The fused momentum buffers: parameter indices (in ``param_groups`` order), last
        parameter first — the order backward produces gradients — cut into buckets of the
        config's ``bucket_size_mb`` (:class:`~lowbit_strategy.layout.Layout`, built at
        :meth:`attach_communicator`). Fixed for the optimizer's life, on every rank: each
        bucket's compressed result depends on which elements share its scale."""
        self._attached()
        return cast(Layout, self.param_layout).buckets  # set with the communicator

    # ---- the DDP hook's entry (compression stage, overlap) ---------------------------------
    @torch.no_grad()
    def grads_ready(self, params: list) -> None:
        """Some parameters' local gradients are final (called from the communication hook
        during backward): start the collective of every layout bucket whose gradients are
        now all ready (DDP calls the hook in the same order on every rank, so every rank
        starts the same buckets in the same order); :meth:`step` finishes them and
        synchronizes the rest."""
        layout = self.layout()
        now = cast(Layout, self.param_layout).indices(params)
        if now & self._ready:  # a second backward before step(): its gradients supersede the first's
            self._ready, self._launched = set(), set()
        self._ready |= now
        keys = [key for key in layout if key not in self._launched and all(i in self._ready for i in key)]
        if not keys:
            return
        slots = cast(Layout, self.param_layout).slots
        # DTensor parameters (FSDP2): the momenta from the local shards, as the step forms them
        if not is_dtensor(slots[keys[0][0]].param):
            self._launch(keys, None)
            return
        with local_step(self):
            self._launch(keys, self._params())

    def _launch(self, keys: list[Key], params: list[torch.Tensor] | None) -> None:
        comm = self._attached()
        for key in keys:  # layout order: the same on every rank
            self._launched.add(key)
            comm.launch(key, self._momenta(key, params))

    def _momenta(self, key: Key, params: list[torch.Tensor] | None = None) -> Formed:
        """This rank's momenta of bucket ``key``, formed where the communicator wants them
        (:class:`~.communicator.Formed`). ``params``: the step's ``param_groups`` parameters
        (inside a ``local_step`` the local tensors that stand for ``DTensor`` ones, keys of the
        step's state); None: the layout's own (the DDP hook's path)."""
        items = []
        slots = cast(Layout, self.param_layout).slots
        for i in key:
            p, group = (params[i] if params is not None else slots[i].param), slots[i].group
            grad = p.grad if p.grad is not None else torch.zeros_like(p)  # unused here: a zero gradient
            items.append((group, p, grad))
        return Formed([p for _, p, _ in items], lambda lo, hi, out: self._momenta_into(items, lo, hi, out))

    def _momenta_into(self, items: list, lo: int, hi: int, out: torch.Tensor) -> None:
        """Elements ``[lo, hi)`` of the momenta of ``items`` (``(group, param, grad)``) laid end
        to end, into float32 ``out``: a float32 parameter's straight into its slice of ``out``
        (:meth:`_local_momentum_into`), any other formed in its dtype and converted, as
        :func:`~lowbit_strategy.buckets.flatten_range` converts it. The same floats either way."""
        start = at = 0
        for group, p, grad in items:
            a, b = max(lo, start), min(hi, start + p.numel())
            if a < b:
                piece = out[at : at + b - a]
                if p.dtype == out.dtype:
                    self._local_momentum_into(group, p, grad, a - start, b - start, piece)
                else:
                    piece.copy_(self._local_momentum(group, p, grad).reshape(-1)[a - start : b - start])
                at += b - a
            start += p.numel()

    def _local_momentum(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """β1·m + (1-β1)·g_i for this rank's gradient, in a new tensor."""
        return self._state(p)["exp_avg"].lerp(grad.view_as(p), 1 - group["betas"][0])

    def _local_momentum_into(
        self, group: dict, p: torch.Tensor, grad: torch.Tensor, a: int, b: int, out: torch.Tensor
    ) -> None:
        """Elements ``[a, b)`` (of the flattened parameter) of :meth:`_local_momentum`, into
        ``out`` (``b - a`` elements of the parameter's dtype): the same elementwise lerp, so the
        same floats, with no parameter-sized temporary."""
        m = self._state(p)["exp_avg"].reshape(-1)[a:b]
        torch.lerp(m, grad.reshape(-1)[a:b], 1 - group["betas"][0], out=out)

    # ---- step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.global_step + 1
        with local_step(self) as self._global_of:  # DTensor parameters (FSDP2): the step runs on their local shards
            applied = self._warmup_step(step) if step <= self._warmup_steps else self._compressed_step(step)
            if applied:
                for group in self.param_groups:
                    group[self._step_key] = step
                if step == self._warmup_steps:
                    self._end_warmup()
        self._global_of = {}
        return loss

    def _skip(self) -> bool:
        self.skipped_steps += 1
        warnings.warn(
            f"{type(self).__name__}: non-finite gradient (NaN/Inf) on at least one rank; step skipped on "
            "every rank, weights, moments and error buffers unchanged",
            RuntimeWarning,
            stacklevel=3,
        )
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
        if self._agreed(any_nonfinite([p.grad for _, p in active])):
            return self._skip()
        self._warmup_all(active, step)
        return bool(active)

    def _compressed_step(self, step: int) -> bool:
        """The compression stage for every parameter of the layout: its mean momentum
        through the communicator (a parameter without a gradient counts as a zero gradient:
        the fused buffer always holds every parameter), then the update. One process: the
        exact momentum (nothing to send)."""
        params, group_of = self._params(), self._group_of()
        self._check_dense(params)
        # one process, or a communicator whose every bucket is the exact mean: the hook
        # averaged the gradients as DDP does, so the local momentum is the mean momentum
        if not self._distributed or self._attached().exact:
            grads = [p.grad for p in params if p.grad is not None]
            if self._agreed(any_nonfinite(grads)):
                return self._skip()
            means = {
                i: self._local_momentum(group_of[id(p)], p, p.grad) for i, p in enumerate(params) if p.grad is not None
            }
            self._alarm, compressing = None, False  # the exact mean: nothing compressed to guard against
        else:
            comm = self._attached()
            layout = self.layout()
            by_key, bad = comm.collect() if comm.pending() else ({}, None)
            rest = [key for key in layout if key not in by_key]
            results, bad_rest = comm.synchronize([(key, self._momenta(key, params)) for key in rest])
            by_key.update(zip(rest, results))
            self._ready, self._launched = set(), set()
            verdicts = [v for v in (bad, bad_rest) if v is not None]
            alarm, self._alarm = self._alarm, None
            # the step's one host read (and, for ranks holding different shards, one small MAX)
            level = self._agreed_level(verdict_level(verdicts, alarm))
            if level == SKIP:
                self._alarm = alarm  # read again with the next step's verdict
                comm.discard()
                return self._skip()
            if level == ALARM:
                comm.discard()
                self._raise_alarm()
            comm.commit()
            means = {i: m for key, ms in by_key.items() for i, m in zip(key, ms)}
            compressing = True
        self._before_compressed_update(compressing)
        self._compressed_all([(group_of[id(params[i])], params[i], mean) for i, mean in means.items()], step)
        self._after_compressed_update(step)
        return bool(means)

    # ---- hooks of a compressed update (the 1-bit optimizers' guard) ----------------------------
    def _before_compressed_update(self, compressing: bool) -> None:
        """Before a compression-stage update; ``compressing``: its momenta came through a
        compressed collective (not the exact mean)."""

    def _after_compressed_update(self, step: int) -> None:
        """After a compression-stage update: a subclass may set :attr:`_alarm`."""

    def _raise_alarm(self) -> None:
        """Every rank agreed that the last update raised the alarm: raise (subclass)."""
        raise RuntimeError(f"{type(self).__name__}: the last compressed update raised an alarm")

    # ---- per-parameter arithmetic (subclasses) ---------------------------------------------
    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _warmup(self, group: dict, p: torch.Tensor, grad: torch.Tensor, step: int) -> None:
        """One warm-up step: ``torch.optim.AdamW`` bit for bit (1-bit LAMB overrides it with LAMB)."""
        self._adamw(group, [p], [grad], step)

    def _adamw(self, group: dict, ps: list[torch.Tensor], grads: list[torch.Tensor], step: int) -> None:
        """AdamW on parameters ``ps`` of ``group`` with gradients ``grads``, multi-tensor
        (:func:`~lowbit_strategy.algorithms.staged.adam.adamw_foreach_`: torch's AdamW bit for
        bit, at the cost of its step rather than one Python call per parameter and operation)."""
        states = [self._state(p) for p in ps]
        beta1, beta2 = group["betas"]
        adam.adamw_foreach_(
            ps,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=step,
        )

    def _compressed(self, group: dict, p: torch.Tensor, mean: torch.Tensor, step: int) -> None:
        raise NotImplementedError

    def _warmup_all(self, active: list[tuple[dict, torch.Tensor]], step: int) -> None:
        """Every warm-up update of a step (``(group, param)`` with a gradient). The base
        :meth:`_warmup` (AdamW) runs as one :meth:`_adamw` per parameter group; a subclass
        that overrides :meth:`_warmup` gets it called on each parameter, or overrides this to
        batch its own (1-bit LAMB)."""
        if type(self)._warmup is not StagedOptimizer._warmup:
            for grp, p in active:
                self._warmup(grp, p, cast(torch.Tensor, p.grad), step)  # active: those with a gradient
            return
        for group in self.param_groups:
            ps = [p for grp, p in active if grp is group]
            if ps:
                self._adamw(group, ps, [cast(torch.Tensor, p.grad) for p in ps], step)

    def _compressed_all(self, items: list[tuple[dict, torch.Tensor, torch.Tensor]], step: int) -> None:
        """Every compression-stage update of a step (``(group, param, mean momentum)``):
        :meth:`_compressed` on each; a subclass may batch them."""
        for grp, p, mean in items:
            self._compressed(grp, p, mean, step)

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
        return [
            (p, p.grad * (1 - grp["betas"][0]))
            for grp in self.param_groups
            for p in grp["params"]
            if p.grad is not None and p.numel()
        ]
