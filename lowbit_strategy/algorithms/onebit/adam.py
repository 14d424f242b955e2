"""1-bit Adam ("1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed", Tang et al., arXiv:2102.02888): AdamW during warm-up, then momentum SGD
preconditioned by the frozen variance (:mod:`.optimizer` has the stages and the choices)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lowbit_strategy.algorithms.onebit.optimizer import OneBitOptimizer


class OneBitAdam(OneBitOptimizer):
    """1-bit Adam: ``torch.optim.AdamW`` for ``freeze_step`` steps, then momentum SGD
    preconditioned by the frozen variance, with the momentum synchronized by the
    error-compensated 1-bit allreduce (~1/32 of fp32's bytes).

    Args (DeepSpeed ``OnebitAdam``'s names): params, lr, betas, eps, weight_decay
    (decoupled, as AdamW), freeze_step (warm-up steps; DeepSpeed's default 100000 —
    set it to ~15-25 % of training). Not in DeepSpeed: ``update_clip`` (``"auto"``: every
    coordinate's compressed-stage step at most Adam's own bound, 3.16·lr at the default
    betas; a number: that bound; ``None``: the paper's unbounded update) and ``guard`` (a
    compressed step whose direction exceeds this many times the last warm-up step's raises
    :class:`~lowbit_strategy.algorithms.onebit.optimizer.DivergenceError`; ``None``: off).
    Why both: :mod:`lowbit_strategy.algorithms.onebit.optimizer`.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100000,
        update_clip: float | str | None = "auto",
        guard: float | None = 1000.0,
    ):
        super().__init__(
            params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), freeze_step, update_clip, guard
        )
        #: keep a fresh variance from the reconstructed gradient in the compression stage (one
        #: more buffer per parameter) and its ratio r to the frozen one, as 1-bit LAMB does, for
        #: diagnostics only: ``callbacks.DivergenceMonitor`` turns it on. The update never uses it.
        self.track_variance = False

    def _compressed(self, group, p, mean, step):
        """One parameter's compression-stage update (Algorithm 1 of the 1-bit Adam paper,
        line 12, with the choices of :mod:`.optimizer`): ``m`` ← the mean momentum (0 where the
        frozen variance is), then the direction ``d = m / (sqrt(v̂) + eps)``, clamped to
        ``± update_clip · (1 - β1^t)`` (so ``|m̂ / (sqrt(v̂) + eps)| ≤ update_clip``), and
        ``p -= lr / (1 - β1^t) · d``. ``d`` is formed once, into the mean's buffer once ``m``
        holds it, and serves the clamp (scalar bounds, in place), the update and the guard's
        norm: four passes over the parameter with the denominator kept (:meth:`_frozen`)."""
        state = self._state(p)
        beta1, beta2 = group["betas"]
        m = state["exp_avg"]
        zero, denom = self._frozen(state["exp_avg_sq"], beta2, group["eps"])
        if self.track_variance:
            new = mean.to(m.dtype).masked_fill_(zero, 0)
            self._track(state, new, beta1, beta2, group["eps"], step)
            m.copy_(new)
        else:
            _masked_into(m, mean, zero)
        if group["weight_decay"]:  # (a multiplication by 1 changes no float: skipped)
            p.mul_(1 - group["lr"] * group["weight_decay"])
        bias1 = 1 - beta1**step
        # the mean is read: its buffer (the communicator's, or the exact path's new tensor)
        # takes the direction, with no parameter-sized allocation (page faults on the CPU)
        d = torch.div(m, denom, out=mean) if mean.dtype == m.dtype and not self.track_variance else torch.div(m, denom)
        if self.update_clip is not None:
            d.clamp_(-self.update_clip * bias1, self.update_clip * bias1)
        p.add_(d, alpha=-(group["lr"] / bias1))
        self._note_directions([d], bias1)

    def _compressed_all(self, items, step):
        """Every compression-stage update of a step. On CUDA parameters (or with
        :attr:`multi_tensor`) as multi-tensor (``torch._foreach_*``) ops per parameter group and
        dtype: :meth:`_compressed`'s operations, a handful of launches for all parameters
        instead of several per parameter (on an H100 the per-parameter loop cost ~20 ms a step
        on GPT-2 small, launch-bound). Elsewhere, and while the variance is tracked,
        :meth:`_compressed` on each parameter (on CPU each parameter's chain then runs in
        cache). The same operations on the same values in the same order, so the same floats:
        on CPU a ``_foreach_`` op runs the single-tensor kernel on every tensor, and the test
        holds the two forms to each other bit for bit."""
        if not self._multi_tensor_on([p for _, p, _ in items]) or self.track_variance:
            return super()._compressed_all(items, step)
        batches: dict = {}
        for item in items:
            batches.setdefault((id(item[0]), item[1].dtype, item[1].device), []).append(item)
        for batch in batches.values():
            group = batch[0][0]
            beta1, beta2 = group["betas"]
            states = [self._state(p) for _, p, _ in batch]
            ms = [s["exp_avg"] for s in states]
            ps = [p for _, p, _ in batch]
            frozen = [self._frozen(s["exp_avg_sq"], beta2, group["eps"]) for s in states]
            for (_, _, mean), m, (zero, _) in zip(batch, ms, frozen):
                _masked_into(m, mean, zero)
            if group["weight_decay"]:
                torch._foreach_mul_(ps, 1 - group["lr"] * group["weight_decay"])
            bias1 = 1 - beta1**step
            ds = torch._foreach_div(ms, [denom for _, denom in frozen])
            if self.update_clip is not None:
                torch._foreach_clamp_min_(ds, -self.update_clip * bias1)
                torch._foreach_clamp_max_(ds, self.update_clip * bias1)
            torch._foreach_add_(ps, ds, alpha=-(group["lr"] / bias1))
            self._note_directions(ds, bias1)


def _masked_into(m: torch.Tensor, mean: torch.Tensor, zero: torch.Tensor) -> None:
    """``m`` ← ``mean``, 0 where ``zero`` (the frozen variance is 0: :mod:`.optimizer`): one
    pass when the dtypes agree (a selection: the same floats as the fill and the copy)."""
    if m.dtype == mean.dtype:
        torch.where(zero, mean.new_zeros(()), mean, out=m)
    else:
        m.copy_(mean.masked_fill_(zero, 0))
