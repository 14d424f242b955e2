"""1-bit Adam ("1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed", Tang et al., arXiv:2102.02888): AdamW during warm-up, then momentum SGD
preconditioned by the frozen variance (:mod:`.optimizer` has the stages and the choices)."""

from __future__ import annotations

from collections.abc import Iterable

from lowbit_strategy.algorithms.onebit.optimizer import _OneBitOptimizer
from lowbit_strategy.algorithms.staged import adam


class OneBitAdam(_OneBitOptimizer):
    """1-bit Adam: ``torch.optim.AdamW`` for ``freeze_step`` steps, then momentum SGD
    preconditioned by the frozen variance, with the momentum synchronized by the
    error-compensated 1-bit allreduce (~1/32 of fp32's bytes).

    Args (DeepSpeed ``OnebitAdam``'s names): params, lr, betas, eps, weight_decay
    (decoupled, as AdamW), freeze_step (warm-up steps; DeepSpeed's default 100000 —
    set it to ~15-25 % of training).
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100000,
    ):
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
        adam.adam_apply_(
            p,
            m,
            state["exp_avg_sq"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            step=step,
            v_step=self.freeze_step,
        )
