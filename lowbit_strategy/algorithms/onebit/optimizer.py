"""1-bit Adam and 1-bit LAMB: two-stage optimizers with error-compensated 1-bit momentum.

Papers: "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed" (Tang et al., arXiv:2102.02888) and "1-bit LAMB: Communication Efficient Large-Scale
Large-Batch Training with LAMB's Convergence Speed" (Li et al., arXiv:2104.06069,
Algorithm 1). Argument names are DeepSpeed's (``OnebitAdam``, ``OnebitLamb``), so a
DeepSpeed optimizer config translates one to one.

**Warm-up** (steps 1..``freeze_step``): the plain optimizer on the rank-averaged gradient
(the DDP hook averages gradients in full precision during warm-up, exactly as DDP does).
``OneBitAdam`` is then ``torch.optim.AdamW`` bit for bit; ``OneBitLamb`` is LAMB (Eq. 2,
with Adam's bias correction) and keeps an EMA of each parameter's trust ratio.

**Switch** (end of step ``freeze_step``, Algorithm 1 line 3): the variance is frozen; LAMB
also freezes its coefficient EMA and computes the momentum scaling coefficients (Sec. 4.3).

**Compression** (later steps, lines 4-13): gradients stay local. Each rank updates its
momentum from its own gradient, m_i = β1·m + (1-β1)·g_i, and the momenta go through the
compensated 1-bit allreduce (one fused buffer per bucket, Sec. 4.2; LAMB scales each
parameter's momentum by its coefficient before and divides after). Every rank gets the same
mean momentum m̄, sets m = m̄ and updates with the frozen variance. The momentum is therefore
identical on every rank after every step; the allreduce's worker and server errors are
rank-local (checkpointed per rank).

**One process** (no communicator, or a world of one): the same two stages without
communication: the compression stage uses the exact momentum.

Choices where the papers and DeepSpeed are silent or differ (each documented where made):

* bias correction: Adam's, in both stages; the frozen variance keeps the correction it had
  when frozen (:func:`~.update.adam_apply_`). DeepSpeed drops it;
* coordinates whose frozen variance is exactly 0 (never had a gradient during warm-up, e.g.
  embedding rows of unseen tokens) get no momentum in the compression stage: m/(sqrt(0)+eps)
  would be a step of size lr/eps. This is what DeepSpeed's hand-made ``exp_avg_mask`` is
  for; here it is automatic;
* LAMB's ratio r is the ratio of Adam denominators, and its clips come in the paper's order
  (:func:`~.update.variance_ratio`, :func:`~.update.clip_ratio`); the coefficient EMA is
  bias-corrected at the switch (divided by 1-β3^freeze_step), so a short warm-up does not
  shrink the learning rate; a ratio of exactly 1 counts like any other (DeepSpeed skips it).

Safety: a step whose gradients hold NaN/Inf on any rank is skipped everywhere (weights,
momenta, variances and error buffers untouched), with a warning; :attr:`skipped_steps`
counts it. ``group["lr"]`` is read at every step, so LR schedulers work.
"""
from __future__ import annotations

import logging
import warnings
from typing import Callable, Iterable

import torch
from torch.optim import Optimizer

from lowbit_strategy import buckets
from lowbit_strategy.algorithms.onebit import update as U
from lowbit_strategy.algorithms.onebit.communicator import Key, OneBitCommunicator

logger = logging.getLogger(__name__)

#: below this share of its averaging weight (1 - β2^freeze_step) a frozen variance is
#: called young and the constructor logs a warning: freeze_step 10 at β2 = 0.999 (1 %)
#: diverged on the e2e GPT, 50 (4.9 %) and 60 (5.8 %) trained well
YOUNG_VARIANCE = 0.02


def _number(cls: str, name: str, value, low: float, high: float | None = None, low_open: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    ok = ok and (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        span = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'})"
        raise ValueError(f"{cls}: {name} must be a number in {span}, got {value!r}")
    return float(value)


class _OneBitOptimizer(Optimizer):
    """The two stages, the communicator wiring and the safety rules of both optimizers;
    subclasses supply the per-parameter arithmetic (:meth:`_warmup`, :meth:`_compressed`)."""

    def __init__(self, params: Iterable, defaults: dict, freeze_step: int):
        name = type(self).__name__
        if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 1:
            raise ValueError(f"{name}: freeze_step must be an int >= 1 (warm-up steps before compression: the "
                             f"variance it freezes must have seen gradients), got {freeze_step!r}")
        betas = defaults["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{name}: betas must be a pair (beta1, beta2), got {betas!r}")
        _number(name, "lr", defaults["lr"], 0.0)
        _number(name, "betas[0]", betas[0], 0.0, 1.0)
        _number(name, "betas[1]", betas[1], 0.0, 1.0)
        _number(name, "eps", defaults["eps"], 0.0, low_open=True)
        _number(name, "weight_decay", defaults["weight_decay"], 0.0)
        super().__init__(params, {**defaults, "betas": tuple(betas)})
        self.freeze_step = freeze_step
        weight = 1 - betas[1] ** freeze_step  # how much of its averaging weight the frozen variance holds
        if weight < YOUNG_VARIANCE:
            logger.warning(
                "%s: freeze_step=%d freezes a variance holding %.1f%% of its averaging weight (1 - beta2**freeze_step). "
                "The 1-bit Adam/LAMB papers freeze after 15-25%% of training; frozen this young, 1-bit momenta "
                "can diverge (seen at freeze_step=10 with beta2=0.999 on a small GPT).", name, freeze_step, 100 * weight)
        self.skipped_steps = 0
        self.attach_communicator(None)

    # ---- stage ---------------------------------------------------------------------
    @property
    def global_step(self) -> int:
        """Optimizer steps taken (skipped ones not counted)."""
        return max((grp.get("onebit_step", 0) for grp in self.param_groups), default=0)

    @property
    def stage(self) -> str:
        """``"warmup"`` or ``"compression"``: the stage of the *next* step."""
        return "warmup" if self.global_step < self.freeze_step else "compression"

    def attach_communicator(self, communicator: OneBitCommunicator | None) -> None:
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
        """The fused momentum buffers (Sec. 4.2): parameter indices (in ``param_groups``
        order), last parameter first — the order backward produces gradients — cut into
        buckets of the config's ``bucket_size_mb``. Fixed for the optimizer's life, on every
        rank: each bucket's compressed result depends on which elements share its scale."""
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
        during backward): start the compressed allreduce of every layout bucket whose
        gradients are now all ready (DDP calls the hook in the same order on every rank,
        so every rank starts the same buckets in the same order); :meth:`step` finishes
        them and synchronizes the rest."""
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
        """β1·m + (1-β1)·g_i for this rank's gradient (Algorithm 1 line 6), in a new tensor."""
        return self._state(p)["exp_avg"].lerp(grad.view_as(p), 1 - group["betas"][0])

    # ---- step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.global_step + 1
        applied = self._warmup_step(step) if step <= self.freeze_step else self._compressed_step(step)
        if applied:
            for group in self.param_groups:
                group["onebit_step"] = step
            if step == self.freeze_step:
                self._freeze()
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
        """Algorithm 1 lines 6-21 for every parameter of the layout: its mean momentum
        through the communicator (a parameter without a gradient counts as a zero gradient:
        the fused buffer always holds every parameter), then the update."""
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
        raise NotImplementedError

    def _compressed(self, group: dict, p: torch.Tensor, mean: torch.Tensor, step: int) -> None:
        raise NotImplementedError

    def _freeze(self) -> None:
        """End of warm-up (Algorithm 1 line 3): ``exp_avg_sq`` is the frozen variance from now on."""

    def _track(self, state: dict, new: torch.Tensor, beta1: float, beta2: float, eps: float, step: int) -> torch.Tensor:
        """Reconstruct the global gradient from this and last step's momentum, fold it into the
        fresh variance and note its unclipped ratio r to the frozen one (1-bit LAMB
        Algorithm 1 lines 15-17); returns r."""
        fresh = state.get("exp_avg_sq_fresh")
        if fresh is None:  # tracking switched on after the switch: start from the frozen variance
            fresh = state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
        grad = (new - state["exp_avg"] * beta1).div_(1 - beta1)
        fresh.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        r = U.variance_ratio(state["exp_avg_sq"], fresh, beta2=beta2, eps=eps, step=step,
                             freeze_step=self.freeze_step).float()
        state["variance_ratio"] = r
        return r

    # ---- diagnostics (callbacks.DivergenceMonitor) -------------------------------------------
    def divergence_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, tensor)`` pairs whose spread across ranks shows how far the ranks' views
        differ: in the compression stage the local part of the momentum each rank sends,
        (1-β1)·g_i (the β1·m part is the same everywhere); nothing during warm-up, when
        gradients are averaged before the step."""
        if self.global_step <= self.freeze_step:
            return []
        return [(p, p.grad * (1 - grp["betas"][0])) for grp in self.param_groups for p in grp["params"]
                if p.grad is not None and p.numel()]

    def variance_ratios(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, r)``: the unclipped ratio of frozen to fresh variance denominators (1-bit
        LAMB's r, Algorithm 1 line 17) of the last compression step, where tracked."""
        return [(p, self.state[p]["variance_ratio"]) for grp in self.param_groups for p in grp["params"]
                if "variance_ratio" in self.state.get(p, {})]

    @staticmethod
    def _masked(mean: torch.Tensor, state: dict) -> torch.Tensor:
        """The mean momentum, 0 where the frozen variance is 0 (module docstring)."""
        return mean.to(state["exp_avg"].dtype).masked_fill_(state["exp_avg_sq"] == 0, 0)


class OneBitAdam(_OneBitOptimizer):
    """1-bit Adam: ``torch.optim.AdamW`` for ``freeze_step`` steps, then momentum SGD
    preconditioned by the frozen variance, with the momentum synchronized by the
    error-compensated 1-bit allreduce (~1/32 of fp32's bytes).

    Args (DeepSpeed ``OnebitAdam``'s names): params, lr, betas, eps, weight_decay
    (decoupled, as AdamW), freeze_step (warm-up steps; DeepSpeed's default 100000 —
    set it to ~15-25 % of training).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100000):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), freeze_step)
        #: keep a fresh variance from the reconstructed gradient in the compression stage (one
        #: more buffer per parameter) and its ratio r to the frozen one, as 1-bit LAMB does, for
        #: diagnostics only: ``callbacks.DivergenceMonitor`` turns it on. The update never uses it.
        self.track_variance = False

    def _warmup(self, group, p, grad, step):
        state = self._state(p)
        beta1, beta2 = group["betas"]
        U.adamw_(p, grad, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"], beta1=beta1, beta2=beta2,
                 eps=group["eps"], weight_decay=group["weight_decay"], step=step)

    def _compressed(self, group, p, mean, step):
        state = self._state(p)
        beta1, beta2 = group["betas"]
        m = state["exp_avg"]
        new = self._masked(mean, state)
        if self.track_variance:
            self._track(state, new, beta1, beta2, group["eps"], step)
        m.copy_(new)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        U.adam_apply_(p, m, state["exp_avg_sq"], lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                      step=step, v_step=self.freeze_step)


class OneBitLamb(_OneBitOptimizer):
    """1-bit LAMB (Algorithm 1): LAMB for ``freeze_step`` steps while keeping an EMA of each
    parameter's trust ratio; then the frozen variance, per-parameter momentum scaling
    coefficients (Sec. 4.3) around the fused compressed allreduce (Sec. 4.2), the gradient
    reconstructed from this and last step's momentum into a fresh variance, and the ratio r
    of frozen to fresh variance, clipped, scaling the frozen coefficient (lines 15-21).

    Args (DeepSpeed ``OnebitLamb``'s names): params, lr, betas, eps, weight_decay (inside
    LAMB's update, scaled by the trust ratio), freeze_step, max_coeff / min_coeff (bounds of
    the warm-up trust ratio), coeff_beta (β3 of its EMA), factor_max / factor_min /
    factor_threshold (bounds and largest relative change per step of r).
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, freeze_step: int = 100000, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1):
        name = type(self).__name__
        _number(name, "min_coeff", min_coeff, 0.0, low_open=True)
        if _number(name, "max_coeff", max_coeff, 0.0, low_open=True) < min_coeff:
            raise ValueError(f"{name}: max_coeff ({max_coeff}) must be >= min_coeff ({min_coeff})")
        _number(name, "coeff_beta", coeff_beta, 0.0, 1.0)
        _number(name, "factor_min", factor_min, 0.0, low_open=True)
        if _number(name, "factor_max", factor_max, 0.0, low_open=True) < factor_min:
            raise ValueError(f"{name}: factor_max ({factor_max}) must be >= factor_min ({factor_min})")
        _number(name, "factor_threshold", factor_threshold, 0.0, 1.0)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                                      min_coeff=min_coeff), freeze_step)
        self.coeff_beta, self.factor_max, self.factor_min = coeff_beta, factor_max, factor_min
        self.factor_threshold = factor_threshold

    def _state(self, p):
        state = super()._state(p)
        if "lamb_coeff_avg" not in state:
            state["lamb_coeff_avg"] = torch.zeros((), dtype=torch.float32, device=p.device)
        return state

    def _warmup(self, group, p, grad, step):
        state = self._state(p)
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        u = U.lamb_update(p, m, v, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                          step=step, v_step=step)
        c = U.trust_ratio(p, u, group["min_coeff"], group["max_coeff"])
        state["lamb_coeff_avg"].lerp_(c, 1 - self.coeff_beta)  # c_avg = β3·c_avg + (1-β3)·c (line 2)
        p.sub_(u.mul_(c.to(u.dtype) * group["lr"]))

    def _freeze(self):
        """Line 3 and Sec. 4.3: fresh variance = frozen one, coefficient EMA frozen (bias-corrected),
        r = 1, and each parameter's momentum scaling coefficient ``mean_l(rms_l) / rms_l``."""
        states = [self._state(p) for grp in self.param_groups for p in grp["params"] if p.numel()]
        if not states:
            return
        rms = [torch.linalg.vector_norm(s["exp_avg"].float()) / s["exp_avg"].numel() ** 0.5 for s in states]
        united = torch.stack(rms).mean()
        for s, r in zip(states, rms):
            s["exp_avg_sq_fresh"] = s["exp_avg_sq"].clone()
            s["lamb_coeff_freeze"] = s["lamb_coeff_avg"] / (1 - self.coeff_beta ** self.freeze_step)
            s["last_factor"] = torch.ones((), dtype=torch.float32, device=r.device)
            s["scaling_coeff"] = torch.where(r > 0, united / r.clamp_min(torch.finfo(torch.float32).tiny),
                                             torch.ones_like(r))

    def _local_momentum(self, group, p, grad):
        # scaled before the compressed allreduce (Sec. 4.3), unscaled in _compressed
        return super()._local_momentum(group, p, grad).mul_(self.state[p]["scaling_coeff"].to(p.dtype))

    def _compressed(self, group, p, mean, step):
        state = self._state(p)
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        new = self._masked(mean.div(state["scaling_coeff"].to(mean.dtype)), state)
        r = self._track(state, new, beta1, beta2, group["eps"], step)  # lines 15-17
        r = U.clip_ratio(r, state["last_factor"], factor_min=self.factor_min, factor_max=self.factor_max,
                         factor_threshold=self.factor_threshold)
        state["last_factor"] = r
        m.copy_(new)
        u = U.lamb_update(p, m, v, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                          step=step, v_step=self.freeze_step)
        p.sub_(u.mul_((r * state["lamb_coeff_freeze"]).to(u.dtype) * group["lr"]))  # lines 20-21
