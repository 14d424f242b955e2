"""Lion, and with a communicator attached, distributed Lion Cub.

Lion (Chen et al. 2023; the rule in Lion Cub Sec. 2, decoupled weight decay):

    c = β1·m + (1-β1)·g
    θ ← θ·(1 - lr·λ) - lr·sign(c)
    m ← β2·m + (1-β2)·g

Without a communicator this is plain single-process Lion, correct on any device and under
any strategy. With one (attached by ``LowBitStrategy``), gradients stay local and the step
is Lion Cub Algorithm 1: each rank forms c_i from its *own* gradient and momentum, the
communicator returns sign(Σ_i Q(c_i)) through a compressed collective, every rank applies
that same direction, and each rank's momentum m_i follows its own gradient (so momenta
differ across ranks: rank-local state, kept per rank in checkpoints by
:mod:`lowbit_strategy.rank_state`).

Safety: a step whose gradients contain NaN/Inf (in any parameter group, on any rank when
distributed) is skipped as a whole — every group's weights and momenta untouched — with a
warning, and :attr:`Lion.skipped_steps` counts it once. Parameters without a gradient on
every rank are skipped consistently on all ranks; a parameter with a gradient on some ranks
only counts as a zero gradient on the others. Zero-element parameters are fine.
``group["lr"]`` is read at every step, so LR schedulers work.

Steps are counted globally (:attr:`Lion.global_step`, stored as ``lion_step`` in every
parameter group so checkpoints carry it): the alternating tie rule and momentum sync
count optimizer steps taken, whichever groups had gradients.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import cast

import torch
from torch.optim import Optimizer

from lowbit_strategy import buckets
from lowbit_strategy.algorithms.lion_cub.communicator import LionCommunicator
from lowbit_strategy.codecs.reduce import nonfinite_flag
from lowbit_strategy.layout import Layout, local_step, local_view
from lowbit_strategy.validation import check_int, check_number, short


class Lion(Optimizer):
    """Lion optimizer; distributed Lion Cub once a :class:`LionCommunicator` is attached.

    Args:
        params: parameters or parameter groups.
        lr: learning rate (Lion wants ~3-10x smaller than AdamW).
        betas: (β1, β2) of the update interpolation and the momentum.
        weight_decay: decoupled weight decay λ (Lion wants ~3-10x larger than AdamW).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ):
        check_number("Lion", "lr", lr, 0.0)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"Lion: betas must be a pair (beta1, beta2), got {short(betas)}")
        check_number("Lion", "betas[0]", betas[0], 0.0, 1.0)
        check_number("Lion", "betas[1]", betas[1], 0.0, 1.0)
        check_number("Lion", "weight_decay", weight_decay, 0.0)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.communicator: LionCommunicator | None = None
        self.param_layout: Layout | None = None
        self.skipped_steps = 0
        self.momentum_syncs = 0
        self.audit_next_step = False
        self._momentum_sync: tuple[int, list[torch.Tensor]] | None = None
        self._global_of: dict[int, torch.Tensor] = {}

    def attach_communicator(
        self, communicator: LionCommunicator | None, names: Mapping[int, str] | None = None
    ) -> None:
        """Make this optimizer distributed Lion Cub (or plain Lion again with None). Its
        :class:`~lowbit_strategy.layout.Layout` (slots, parameter ``names`` for checkpoints:
        ``id(param) -> name``) is built here, once, from the local tensors. Lion's buckets are
        whatever a launch site hands over together (and, at the step, the layout's order cut
        at ``bucket_size_mb``): every mode's code is per element and its L_p scale per
        parameter, so which parameters share a collective changes no result."""
        self.communicator = communicator
        self.param_layout = None
        if communicator is not None:
            size = buckets.bucket_numel(communicator.config.bucket_size_mb)
            self.param_layout = Layout(self.param_groups, size, names)

    def momentum(self, p: torch.Tensor) -> torch.Tensor:
        """The momentum buffer of ``p`` (created as zeros on first use)."""
        state = self.state[p]
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state["exp_avg"]

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (skipped ones not counted); the next step is ``global_step + 1``."""
        return max((grp.get("lion_step", 0) for grp in self.param_groups), default=0)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # DTensor parameters (FSDP2): the step runs on their local shards
        with local_step(self) as self._global_of:
            self._step()
        self._global_of = {}
        return loss

    def _step(self) -> None:
        # the communicator when there are other ranks to talk to, else None
        comm = self.communicator if self.communicator is not None and self.communicator.world_size > 1 else None
        distributed = comm is not None
        audit, self.audit_next_step = self.audit_next_step, False
        params = [p for grp in self.param_groups for p in grp["params"]]
        given: dict[int, torch.Tensor] = {}
        nonfinite: torch.Tensor | None = None  # the hook's buckets' verdict, on the device
        rest = params
        if comm is not None and comm.pending():
            # buckets launched from the DDP hook during backward: wait for their directions;
            # the non-finite flags came with the payloads. Parameters DDP did not bucket
            # (the same on every rank) take the step-time path below.
            given, nonfinite = comm.collect(audit)
            if self._global_of:  # launched with the DTensor parameters (FSDP2): keyed by their locals here
                given = {lid: given[id(p)] for lid, p in self._global_of.items() if id(p) in given}
            rest = [p for p in params if id(p) not in given and p.requires_grad and p.numel()]
        has_grad = self._has_grad(rest)
        present = [p.grad for p, h in zip(rest, has_grad) if h]
        # one device-side flag for the whole step (this rank's gradients outside the hook's
        # buckets, and every rank's verdict on those inside), read once: one host sync per step
        flags = ([nonfinite_flag(*present)] if present else []) + ([nonfinite] if nonfinite is not None else [])
        bad = torch.stack(flags).any() if flags else None
        if comm is not None and rest:
            has_grad, bad_somewhere = comm.agree(has_grad, bad, rest[0].device)
        else:
            bad_somewhere = bool(bad) if bad is not None else False
            spec = getattr(self.communicator, "spec", None)
            if spec is not None:  # one worker, ranks holding different shards: one verdict
                bad_somewhere = spec.agree(bad_somewhere)
        if bad_somewhere:
            self.skipped_steps += 1
            warnings.warn(
                "Lion: non-finite gradient (NaN/Inf) on at least one rank; step skipped in every "
                "parameter group, weights and momentum unchanged",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        chosen = {id(p) for p, h in zip(rest, has_grad) if h}
        chosen.update(id(p) for p in params if id(p) in given and p.grad is not None)
        if not chosen:
            return
        step = self.global_step + 1
        for group in self.param_groups:
            active = [p for p in group["params"] if id(p) in chosen]
            if active:
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in active]
                self._update(group, active, grads, comm, step, audit, given)
        for group in self.param_groups:
            group["lion_step"] = step
        if self._momentum_sync is not None and distributed:
            every, selected = self._momentum_sync
            if step % every == 0:
                self.sync_momentum(selected)

    @torch.no_grad()
    def launch_bucket(self, params: list, grads: list, nonfinite: torch.Tensor) -> None:
        """Form this rank's update vectors c = β1·m + (1-β1)·g for one DDP bucket's
        parameters (called from the communication hook during backward) and hand them to
        the communicator, which starts their collective at once; :meth:`step` finishes it.
        ``nonfinite``: a device-side flag, whether this rank's bucket holds NaN/Inf."""
        if self.communicator is None or self.param_layout is None:
            raise RuntimeError("Lion.launch_bucket needs a communicator (see attach_communicator)")
        slots = self.param_layout.slots
        key = tuple(cast(int, self.param_layout.index_of(p)) for p in params)  # the layout's parameters
        updates = []
        for i, p, gr in zip(key, params, grads):
            beta1 = slots[i].group["betas"][0]
            # on the local tensors (a DTensor's shard: the step's arithmetic, without DTensor dispatch)
            m = local_view(self.momentum(p))
            updates.append(m.mul(beta1).add_(local_view(gr).view_as(m), alpha=1 - beta1))
        self.communicator.launch(params, updates, self.global_step + 1, nonfinite, key=key)

    @staticmethod
    def _has_grad(params: list) -> list[bool]:
        has_grad = [p.grad is not None for p in params]
        for p, h in zip(params, has_grad):
            if h and p.grad.is_sparse:
                raise RuntimeError("Lion does not support sparse gradients; use dense embeddings")
        return has_grad

    def set_momentum_sync(self, every: int, params: Iterable[torch.Tensor]) -> None:
        """Average the momentum of ``params`` across ranks after every ``every``-th
        optimizer step (:attr:`global_step`; Lion Cub Sec. 5); ``every=0`` turns it off."""
        check_int("Lion.set_momentum_sync", "every", every, 0)
        self._momentum_sync = (every, list(params)) if every else None

    def _update(
        self,
        group: dict,
        params: list,
        grads: list,
        comm: LionCommunicator | None,
        step: int,
        audit: bool,
        given: dict[int, torch.Tensor],
    ) -> None:
        """One Lion step for ``params`` of ``group``; ``given`` holds directions already
        synchronized from the DDP hook, the others are computed here."""
        beta1, beta2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        moms = [self.momentum(p) for p in params]
        missing = [i for i, p in enumerate(params) if id(p) not in given]
        directions = [given.get(id(p)) for p in params]
        if missing:
            updates = torch._foreach_mul([moms[i] for i in missing], beta1)
            torch._foreach_add_(updates, [grads[i] for i in missing], alpha=1 - beta1)
            if comm is None:  # the update vectors are this step's own: signed in place, no second allocation
                torch._foreach_sign_(updates)
            computed = updates if comm is None else comm.directions(updates, step, audit=audit)
            for i, d in zip(missing, computed):
                directions[i] = d
        if wd:
            torch._foreach_mul_(params, 1 - lr * wd)
        torch._foreach_add_(params, cast(list[torch.Tensor], directions), alpha=-lr)  # all filled above
        torch._foreach_mul_(moms, beta2)
        torch._foreach_add_(moms, grads, alpha=1 - beta2)

    def divergence_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, momentum)`` for every parameter (zeros before its first step): the
        rank-local tensors whose spread across ranks ``callbacks.DivergenceMonitor`` reports
        (Lion Cub Fig. 6)."""
        return [
            (p, self.state[p].get("exp_avg", torch.zeros_like(p)))
            for grp in self.param_groups
            for p in grp["params"]
            if p.numel()
        ]

    def sync_momentum(self, params: Iterable[torch.Tensor]) -> int:
        """Average the momentum of ``params`` across ranks (Lion Cub Sec. 5). Returns how
        many momenta were averaged; a no-op without a distributed communicator."""
        selected = {id(p) for p in params}
        of = self._global_of  # inside a local_step: local tensor -> its DTensor parameter
        tensors = [
            self.momentum(p) for grp in self.param_groups for p in grp["params"] if id(of.get(id(p), p)) in selected
        ]
        if self.communicator is not None:
            self.communicator.average_(tensors)
            self.momentum_syncs += 1
        return len(tensors)
