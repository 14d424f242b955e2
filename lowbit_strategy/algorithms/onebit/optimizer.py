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
  when frozen (:func:`~lowbit_strategy.algorithms.staged.adam.adam_denominator`). DeepSpeed drops it;
* coordinates whose frozen variance is exactly 0 (never had a gradient during warm-up, e.g.
  embedding rows of unseen tokens) get no momentum in the compression stage: m/(sqrt(0)+eps)
  would be a step of size lr/eps. This is what DeepSpeed's hand-made ``exp_avg_mask`` is
  for; here it is automatic;
* the compression stage bounds every coordinate's Adam direction ``|m̂ / (sqrt(v̂) + eps)|``
  by ``update_clip`` (default ``"auto"``: Adam's own bound, :func:`adam_step_bound`, 3.16 at
  the default betas; ``None``: the papers' unbounded form). The 1-bit code hands every
  coordinate its momentum's sign times its block's scale, whatever its own size; where the
  frozen variance is tiny but not 0 that becomes a step of up to ``lr·scale/eps``. The
  measured case: attention key biases, whose exact gradient is 0 (the softmax does not see
  a constant added to every key) and whose float gradient is rounding noise, ``sqrt(v̂)`` ~
  1e-11: their first compressed steps were 1e4-1e6 times AdamW's, and a 60-step fine-tune
  (freeze at 12) ended at a loss of 893,362 on one CPU and 3.22 on another. The warm-up is
  untouched (AdamW / LAMB bit for bit either way); a healthy 200-step run ends at the same
  loss to 4 digits;
* a guard: the size of each compressed step's direction ``‖m̂ / (sqrt(v̂) + eps)‖`` against
  the last warm-up step's (this rank's parameters or shards), and when it exceeds ``guard``
  times that (default 1000; with the default clip it stays below ~30) the next step raises
  :class:`DivergenceError` on every rank, naming the step, the ratio and the remedies,
  instead of training on into a loss of 1e5. Checked with the step's one host read, so it
  speaks one step late; ``guard=None`` turns it off;
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
from collections.abc import Iterable, Sequence

import torch

from lowbit_strategy.algorithms.staged import StagedOptimizer, adam
from lowbit_strategy.validation import check_number

logger = logging.getLogger(__name__)


#: below this share of its averaging weight (1 - β2^freeze_step) a frozen variance is
#: called young and the constructor logs a warning: freeze_step 10 at β2 = 0.999 (1 %)
#: diverged on the e2e GPT, 50 (4.9 %) and 60 (5.8 %) trained well
YOUNG_VARIANCE = 0.02


def adam_step_bound(beta1: float, beta2: float) -> float:
    """The largest step Adam itself takes per coordinate, in units of lr ("Adam", Kingma &
    Ba, arXiv:1412.6980, Sec. 2.1): ``(1-β1)/sqrt(1-β2)`` where that exceeds 1, else 1.
    3.16 at β = (0.9, 0.999); 1 at (0.9, 0.95)."""
    return max(1.0, (1 - beta1) / (1 - beta2) ** 0.5)


class DivergenceError(RuntimeError):
    """A compression-stage step far outside Adam's envelope (:class:`OneBitOptimizer`'s
    guard); raised on every rank alike."""


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


class OneBitOptimizer(StagedOptimizer):
    """The two stages (:class:`~lowbit_strategy.algorithms.staged.StagedOptimizer`) with a
    variance frozen at ``freeze_step``; subclasses supply the per-parameter arithmetic
    (:meth:`_warmup`, :meth:`_compressed`)."""

    def __init__(
        self,
        params: Iterable,
        defaults: dict,
        freeze_step: int,
        update_clip: float | str | None = "auto",
        guard: float | None = 1000.0,
    ):
        name = type(self).__name__
        super().__init__(params, defaults, freeze_step, "freeze_step", "onebit_step")
        self.freeze_step = freeze_step
        if update_clip == "auto":
            update_clip = adam_step_bound(*self.defaults["betas"])
        elif isinstance(update_clip, str):
            raise ValueError(
                f"{name}: update_clip must be 'auto' (Adam's own step bound), a positive number or None "
                f"(the papers' unbounded form), got {update_clip!r}"
            )
        elif update_clip is not None:
            update_clip = check_number(name, "update_clip", update_clip, 0.0, low_open=True)
        #: bound on each coordinate's ``|m̂ / (sqrt(v̂) + eps)|`` in the compression stage (None: none)
        self.update_clip: float | None = update_clip
        #: a compressed step's direction larger than this times the warm-up's raises (None: no guard)
        self.guard = None if guard is None else check_number(name, "guard", guard, 1.0, low_open=True)
        #: per compressed step: the squared norms of the parameters' directions (guard)
        self._directions: list[torch.Tensor] | None = None
        self._alarm_info: tuple[int, torch.Tensor, torch.Tensor] | None = None
        #: the compression stage's constants of each frozen variance (:meth:`_frozen`), and the
        #: keys the current compressed step used
        self._frozen_cache: dict[tuple, tuple] = {}
        self._frozen_used: set[tuple] = set()
        #: the per-parameter tensor chains as multi-tensor (``torch._foreach_*``) ops: True,
        #: False, or ``None`` = on CUDA parameters only (there a dozen small launches per
        #: parameter cost more than the arithmetic; on CPU each parameter's chain runs in cache)
        self.multi_tensor: bool | None = None
        betas = self.defaults["betas"]
        weight = 1 - betas[1] ** freeze_step  # how much of its averaging weight the frozen variance holds
        if weight < YOUNG_VARIANCE and self.update_clip is None:
            logger.warning(
                "%s: freeze_step=%d freezes a variance holding %.1f%% of its averaging weight "
                "(1 - beta2**freeze_step), and update_clip=None leaves the compressed steps unbounded. "
                "The 1-bit Adam/LAMB papers freeze after 15-25%% of training; frozen this young, 1-bit momenta "
                "can diverge (seen at freeze_step=10 with beta2=0.999 on a small GPT); update_clip='auto' "
                "bounds every step by Adam's own.",
                name,
                freeze_step,
                100 * weight,
            )

    def _multi_tensor_on(self, ps: list[torch.Tensor]) -> bool:
        """Whether the step runs ``ps``'s chains as multi-tensor ops (:attr:`multi_tensor`)."""
        return self.multi_tensor if self.multi_tensor is not None else bool(ps) and ps[0].is_cuda

    def _end_warmup(self) -> None:
        self._note_warmup_direction()
        self._freeze()

    # ---- the guard (module docstring) --------------------------------------------------------
    def _note_warmup_direction(self) -> None:
        """The guard's reference: each parameter's ``‖m̂ / (sqrt(v̂) + eps)‖²`` at the last
        warm-up step (this rank's part of it), kept in its state, so a checkpoint carries it."""
        step = self.freeze_step
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                st = self._state(p)
                denom = st["exp_avg_sq"].float().sqrt().div_((1 - beta2**step) ** 0.5).add_(group["eps"])
                direction = st["exp_avg"].float().div(1 - beta1**step).div_(denom)
                st["warmup_direction_sq"] = torch.linalg.vector_norm(direction).square()

    def _before_compressed_update(self, compressing: bool) -> None:
        self._directions = [] if compressing and self.guard is not None else None
        self._frozen_used = set()

    # ---- the frozen variance's constants -----------------------------------------------------
    def _frozen(self, v: torch.Tensor, beta2: float, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(v == 0, sqrt(v̂) + eps)`` of a frozen variance ``v`` (v̂ with its freeze-time bias
        correction, :func:`~lowbit_strategy.algorithms.staged.adam.adam_denominator`): constants of
        the compression stage (Algorithm 1 of both papers freezes v), so computed once, not at
        every step: a comparison and three passes over the parameter fewer per step, for one
        more parameter-sized buffer and a bool per element, kept outside the state dict
        (checkpoints are unchanged). Recomputed when ``v`` was written (its version: a state
        copied in place) or ``eps``/``beta2`` changed; the same floats as computing them each step.

        Keyed by where ``v``'s values live (device, storage, offset, shape, strides), not by
        tensor objects: on the sharded path every step sees new local views of the same
        parameters and state (:func:`~lowbit_strategy.layout.local_step`), and a cache keyed by
        objects missed every step and grew by a mask and a denominator per parameter and step.
        The entry holds ``v``, so its storage cannot be freed and its address reused while the
        entry lives; the entries a compressed step did not use (a replaced state's) are dropped
        at its end (:meth:`_after_compressed_update`)."""
        key = (v.device, v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.stride(), v.dtype)
        hit = self._frozen_cache.get(key)
        if hit is None or hit[1] != v._version or hit[2] != (beta2, eps):
            denom = adam.adam_denominator(v, beta2=beta2, eps=eps, v_step=self.freeze_step)
            hit = self._frozen_cache[key] = (v, v._version, (beta2, eps), v == 0, denom)
        self._frozen_used.add(key)
        return hit[3], hit[4]

    def _drop_unused_frozen(self) -> None:
        for key in [k for k in self._frozen_cache if k not in self._frozen_used]:
            del self._frozen_cache[key]

    def _note_directions(self, ds: Sequence[torch.Tensor], bias1: float) -> None:
        """The compressed step's directions ``ds[i] / (1 - β1^t)``, ``ds[i] = m / (sqrt(v̂) + eps)``
        as the update used them (guard); a no-op when not guarding this step."""
        if self._directions is None or not ds:
            return
        self._directions += [n.float().div(bias1).square() for n in torch._foreach_norm(list(ds))]

    def _note_updates(self, us: Sequence[torch.Tensor]) -> None:
        """The compressed step's directions, formed already (1-bit LAMB's ``u`` before weight
        decay)."""
        if self._directions is None or not us:
            return
        self._directions += [n.float().square() for n in torch._foreach_norm(list(us))]

    def _after_compressed_update(self, step: int) -> None:
        self._drop_unused_frozen()
        directions, self._directions = self._directions, None
        if not directions or self.guard is None:
            return
        states = [self.state.get(p, {}) for group in self.param_groups for p in group["params"]]
        refs = [st.get("warmup_direction_sq") for st in states if "exp_avg" in st]
        if not refs or any(r is None for r in refs):  # a state saved before the guard existed
            return
        now, then = torch.stack(directions).sum(), torch.stack(refs).sum()
        self._alarm = (now > self.guard**2 * then) & (then > 0)
        self._alarm_info = (step, now, then)

    def _raise_alarm(self) -> None:
        step, now, then = self._alarm_info or (0, torch.ones(()), torch.ones(()))
        ratio = float((now / then).sqrt())
        beta1, beta2 = self.defaults["betas"]
        raise DivergenceError(
            f"{type(self).__name__}: compressed step {step} moved the parameters along a direction "
            f"‖m̂/(sqrt(v̂)+eps)‖ {ratio:.3g} times the last warm-up step's (guard={self.guard:g}; Adam's own step "
            f"is at most {adam_step_bound(beta1, beta2):.3g} per coordinate): the run is diverging. Remedies: "
            f"update_clip='auto' (Adam's bound; this run has update_clip={self.update_clip}), a later freeze_step "
            f"(this run: {self.freeze_step}; the papers freeze after 15-25 % of training), a lower lr; "
            "guard=None trains on regardless"
        )

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
