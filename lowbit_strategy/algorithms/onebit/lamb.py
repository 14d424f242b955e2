"""1-bit LAMB ("1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training with
LAMB's Convergence Speed", Li et al., arXiv:2104.06069, Algorithm 1): LAMB's arithmetic
(pure tensor functions, also used by the tests' references) and :class:`OneBitLamb`
(:mod:`.optimizer` has the stages and the choices shared with 1-bit Adam)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lowbit_strategy.algorithms.onebit.optimizer import _OneBitOptimizer
from lowbit_strategy.validation import check_number


def lamb_update(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    v_step: int,
) -> torch.Tensor:
    """LAMB's update direction u = m̂ / (sqrt(v̂) + eps) + λ·p (1-bit LAMB Eq. 2, with Adam's
    bias correction as in You et al.'s LAMB)."""
    denom = (v.sqrt() / (1 - beta2**v_step) ** 0.5).add_(eps)
    u = (m / (1 - beta1**step)).div_(denom)
    if weight_decay:
        u.add_(p, alpha=weight_decay)
    return u


def trust_ratio(p: torch.Tensor, u: torch.Tensor, min_coeff: float, max_coeff: float) -> torch.Tensor:
    """LAMB's scaling coefficient c = clip(‖p‖ / ‖u‖, c_min, c_max) (1-bit LAMB Eq. 2, the
    clip applied to the whole ratio); 1 where either norm is 0 (a zero weight or a zero
    update: no ratio to speak of). A 0-d tensor: no host sync."""
    wn, un = torch.linalg.vector_norm(p.float()), torch.linalg.vector_norm(u.float())
    ratio = torch.where((wn > 0) & (un > 0), wn / un.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(wn))
    return ratio.clamp(min_coeff, max_coeff)


def clip_ratio(
    r: torch.Tensor, last: torch.Tensor, *, factor_min: float, factor_max: float, factor_threshold: float
) -> torch.Tensor:
    """Algorithm 1 lines 18-19, in the paper's order: first within ±``factor_threshold`` of
    the previous ratio, then within [``factor_min``, ``factor_max``].

    DeepSpeed clips in the other order (bounds first, then the rate); the paper's order
    makes the bounds hard limits, which is what a user setting ``factor_max`` expects."""
    r = torch.minimum(torch.maximum(r, last * (1 - factor_threshold)), last * (1 + factor_threshold))
    return r.clamp(factor_min, factor_max)


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

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100000,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ):
        name = type(self).__name__
        check_number(name, "min_coeff", min_coeff, 0.0, low_open=True)
        if check_number(name, "max_coeff", max_coeff, 0.0, low_open=True) < min_coeff:
            raise ValueError(f"{name}: max_coeff ({max_coeff}) must be >= min_coeff ({min_coeff})")
        check_number(name, "coeff_beta", coeff_beta, 0.0, 1.0)
        check_number(name, "factor_min", factor_min, 0.0, low_open=True)
        if check_number(name, "factor_max", factor_max, 0.0, low_open=True) < factor_min:
            raise ValueError(f"{name}: factor_max ({factor_max}) must be >= factor_min ({factor_min})")
        check_number(name, "factor_threshold", factor_threshold, 0.0, 1.0)
        super().__init__(
            params,
            dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_coeff=max_coeff, min_coeff=min_coeff),
            freeze_step,
        )
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
        u = lamb_update(
            p,
            m,
            v,
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=step,
            v_step=step,
        )
        c = trust_ratio(p, u, group["min_coeff"], group["max_coeff"])
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
            s["lamb_coeff_freeze"] = s["lamb_coeff_avg"] / (1 - self.coeff_beta**self.freeze_step)
            s["last_factor"] = torch.ones((), dtype=torch.float32, device=r.device)
            s["scaling_coeff"] = torch.where(
                r > 0, united / r.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(r)
            )

    def _local_momentum(self, group, p, grad):
        # scaled before the compressed allreduce (Sec. 4.3), unscaled in _compressed
        return super()._local_momentum(group, p, grad).mul_(self.state[p]["scaling_coeff"].to(p.dtype))

    def _compressed(self, group, p, mean, step):
        state = self._state(p)
        beta1, beta2 = group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        new = self._masked(mean.div(state["scaling_coeff"].to(mean.dtype)), state)
        r = self._track(state, new, beta1, beta2, group["eps"], step)  # lines 15-17
        r = clip_ratio(
            r,
            state["last_factor"],
            factor_min=self.factor_min,
            factor_max=self.factor_max,
            factor_threshold=self.factor_threshold,
        )
        state["last_factor"] = r
        m.copy_(new)
        u = lamb_update(
            p,
            m,
            v,
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=step,
            v_step=self.freeze_step,
        )
        p.sub_(u.mul_((r * state["lamb_coeff_freeze"]).to(u.dtype) * group["lr"]))  # lines 20-21
