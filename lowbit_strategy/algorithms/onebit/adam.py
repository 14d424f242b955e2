"""1-bit Adam ("1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed", Tang et al., arXiv:2102.02888): AdamW during warm-up, then momentum SGD
preconditioned by the frozen variance (:mod:`.optimizer` has the stages and the choices)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lowbit_strategy.algorithms.onebit.optimizer import OneBitOptimizer
from lowbit_strategy.algorithms.staged import adam


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
        #: per parameter: (its exp_avg_sq, that tensor's version, where it is 0)
        self._zero_cache: dict[torch.Tensor, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def _compressed(self, group, p, mean, step):
        state = self._state(p)
        beta1, beta2 = group["betas"]
        m = state["exp_avg"]
        new = self._masked(mean, state)
        if self.track_variance:
            self._track(state, new, beta1, beta2, group["eps"], step)
        m.copy_(new)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        used, denom = adam.adam_apply_(
            p,
            m,
            state["exp_avg_sq"],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            step=step,
            v_step=self.freeze_step,
            clip=self.update_clip,
        )
        self._note_directions([used], [denom], 1 - beta1**step)

    def _compressed_all(self, items, step):
        """Every compression-stage update of a step. On CUDA parameters (or with
        :attr:`multi_tensor`) as multi-tensor (``torch._foreach_*``) ops per parameter group and
        dtype: the mask of :meth:`_masked` per parameter (``v == 0`` kept, as 1-bit LAMB keeps it)
        and a handful of launches for all parameters instead of ~9 per parameter (on an H100
        the per-parameter loop cost ~20 ms a step on GPT-2 small, launch-bound). Elsewhere,
        and while the variance is tracked, :meth:`_compressed` on each parameter (on CPU each
        parameter's chain then runs in cache). The same operations on the same values in the
        same order, so the same floats: on CPU a ``_foreach_`` op runs the single-tensor kernel
        on every tensor, and the test holds the two forms to each other bit for bit."""
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
            vs = [s["exp_avg_sq"] for s in states]
            ps = [p for _, p, _ in batch]
            zeros = self._zeros(ps, vs)
            news = [mean.to(m.dtype).masked_fill_(zero, 0) for (_, _, mean), m, zero in zip(batch, ms, zeros)]
            torch._foreach_copy_(ms, news)
            torch._foreach_mul_(ps, 1 - group["lr"] * group["weight_decay"])
            denom = torch._foreach_sqrt(vs)  # adam_apply_ with v_step = freeze_step
            torch._foreach_div_(denom, (1 - beta2**self.freeze_step) ** 0.5)
            torch._foreach_add_(denom, group["eps"])
            bias1 = 1 - beta1**step
            used = ms if self.update_clip is None else adam.clip_momentum_foreach(ms, denom, self.update_clip * bias1)
            torch._foreach_addcdiv_(ps, used, denom, value=-(group["lr"] / bias1))
            self._note_directions(used, denom, bias1)

    def _zeros(self, ps: list[torch.Tensor], vs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``v == 0`` of each parameter's frozen variance ``vs[i]``: a constant of the
        compression stage, kept per parameter for that tensor and its version (a loaded state
        or a write recomputes it), as 1-bit LAMB keeps it (a bool per element; no host read)."""
        cache = self._zero_cache
        out = []
        for p, v in zip(ps, vs):
            hit = cache.get(p)
            if hit is None or hit[0] is not v or hit[1] != v._version:
                hit = cache[p] = (v, v._version, v == 0)
            out.append(hit[2])
        return out
