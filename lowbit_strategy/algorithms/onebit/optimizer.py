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
  when frozen (:func:`~lowbit_strategy.algorithms.staged.adam.adam_apply_`). DeepSpeed drops it;
* coordinates whose frozen variance is exactly 0 (never had a gradient during warm-up, e.g.
  embedding rows of unseen tokens) get no momentum in the compression stage: m/(sqrt(0)+eps)
  would be a step of size lr/eps. This is what DeepSpeed's hand-made ``exp_avg_mask`` is
  for; here it is automatic;
* LAMB's ratio r is the ratio of Adam denominators, and its clips come in the paper's order
  (:func:`variance_ratio`, :func:`~.lamb.clip_ratio`); the coefficient EMA is
  bias-corrected at the switch (divided by 1-β3^freeze_step), so a short warm-up does not
  shrink the learning rate; a ratio of exactly 1 counts like any other (DeepSpeed skips it).

Safety: a step whose gradients hold NaN/Inf on any rank is skipped everywhere (weights,
momenta, variances and error buffers untouched), with a warning; :attr:`skipped_steps`
counts it. ``group["lr"]`` is read at every step, so LR schedulers work.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from lowbit_strategy.algorithms.staged import StagedOptimizer

logger = logging.getLogger(__name__)


#: below this share of its averaging weight (1 - β2^freeze_step) a frozen variance is
#: called young and the constructor logs a warning: freeze_step 10 at β2 = 0.999 (1 %)
#: diverged on the e2e GPT, 50 (4.9 %) and 60 (5.8 %) trained well
YOUNG_VARIANCE = 0.02


def variance_ratio(
    v_frozen: torch.Tensor, v_fresh: torch.Tensor, *, beta2: float, eps: float, step: int, freeze_step: int
) -> torch.Tensor:
    """1-bit LAMB's scaling ratio r_t before clipping (Algorithm 1 line 17), as the largest
    ratio of Adam *denominators*, ``max((sqrt(v̂_frozen) + eps) / (sqrt(v̂_fresh) + eps))``.

    The paper writes ``‖v_frozen / v_fresh‖_∞``, a ratio of variances; we take the ratio of
    their square roots plus eps, as DeepSpeed's ``OnebitLamb`` does: it is what the frozen
    variance actually changes in the update (m / (sqrt(v) + eps)), it stays finite where the
    fresh variance is 0, and the defaults factor_min=0.5, factor_max=4 were tuned for it.
    """
    frozen = (v_frozen.sqrt() / (1 - beta2**freeze_step) ** 0.5).add_(eps)
    fresh = (v_fresh.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    if frozen.numel() == 0:
        return torch.ones((), dtype=frozen.dtype, device=frozen.device)
    return (frozen / fresh).max()


class _OneBitOptimizer(StagedOptimizer):
    """The two stages (:class:`~lowbit_strategy.algorithms.staged.StagedOptimizer`) with a
    variance frozen at ``freeze_step``; subclasses supply the per-parameter arithmetic
    (:meth:`_warmup`, :meth:`_compressed`)."""

    def __init__(self, params: Iterable, defaults: dict, freeze_step: int):
        name = type(self).__name__
        super().__init__(params, defaults, freeze_step, "freeze_step", "onebit_step")
        self.freeze_step = freeze_step
        #: the per-parameter tensor chains as multi-tensor (``torch._foreach_*``) ops: True,
        #: False, or ``None`` = on CUDA parameters only (there a dozen small launches per
        #: parameter cost more than the arithmetic; on CPU each parameter's chain runs in cache)
        self.multi_tensor: bool | None = None
        betas = self.defaults["betas"]
        weight = 1 - betas[1] ** freeze_step  # how much of its averaging weight the frozen variance holds
        if weight < YOUNG_VARIANCE:
            logger.warning(
                "%s: freeze_step=%d freezes a variance holding %.1f%% of its averaging weight "
                "(1 - beta2**freeze_step). "
                "The 1-bit Adam/LAMB papers freeze after 15-25%% of training; frozen this young, 1-bit momenta "
                "can diverge (seen at freeze_step=10 with beta2=0.999 on a small GPT).",
                name,
                freeze_step,
                100 * weight,
            )

    def _multi_tensor_on(self, ps: list[torch.Tensor]) -> bool:
        """Whether the step runs ``ps``'s chains as multi-tensor ops (:attr:`multi_tensor`)."""
        return self.multi_tensor if self.multi_tensor is not None else bool(ps) and ps[0].is_cuda

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
        r = variance_ratio(
            state["exp_avg_sq"], fresh, beta2=beta2, eps=eps, step=step, freeze_step=self.freeze_step
        ).float()
        state["variance_ratio"] = r
        return r

    # ---- diagnostics (callbacks.DivergenceMonitor) -------------------------------------------
    def variance_ratios(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(param, r)``: the unclipped ratio of frozen to fresh variance denominators (1-bit
        LAMB's r, Algorithm 1 line 17) of the last compression step, where tracked."""
        return [
            (p, self.state[p]["variance_ratio"])
            for grp in self.param_groups
            for p in grp["params"]
            if "variance_ratio" in self.state.get(p, {})
        ]

    @staticmethod
    def _masked(mean: torch.Tensor, state: dict) -> torch.Tensor:
        """The mean momentum, 0 where the frozen variance is 0 (module docstring)."""
        return mean.to(state["exp_avg"].dtype).masked_fill_(state["exp_avg_sq"] == 0, 0)
