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
from typing import Iterable

import torch

from lowbit_strategy.algorithms.onebit import update as U
from lowbit_strategy.algorithms.staged import StagedOptimizer
from lowbit_strategy.algorithms.staged import check_number as _number

logger = logging.getLogger(__name__)

#: below this share of its averaging weight (1 - β2^freeze_step) a frozen variance is
#: called young and the constructor logs a warning: freeze_step 10 at β2 = 0.999 (1 %)
#: diverged on the e2e GPT, 50 (4.9 %) and 60 (5.8 %) trained well
YOUNG_VARIANCE = 0.02


class _OneBitOptimizer(StagedOptimizer):
    """The two stages (:class:`~lowbit_strategy.algorithms.staged.StagedOptimizer`) with a
    variance frozen at ``freeze_step``; subclasses supply the per-parameter arithmetic
    (:meth:`_warmup`, :meth:`_compressed`)."""

    def __init__(self, params: Iterable, defaults: dict, freeze_step: int):
        name = type(self).__name__
        super().__init__(params, defaults, freeze_step, "freeze_step", "onebit_step")
        self.freeze_step = freeze_step
        betas = self.defaults["betas"]
        weight = 1 - betas[1] ** freeze_step  # how much of its averaging weight the frozen variance holds
        if weight < YOUNG_VARIANCE:
            logger.warning(
                "%s: freeze_step=%d freezes a variance holding %.1f%% of its averaging weight (1 - beta2**freeze_step). "
                "The 1-bit Adam/LAMB papers freeze after 15-25%% of training; frozen this young, 1-bit momenta "
                "can diverge (seen at freeze_step=10 with beta2=0.999 on a small GPT).", name, freeze_step, 100 * weight)

    def _end_warmup(self) -> None:
        self._freeze()

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
