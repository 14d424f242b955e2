"""1-bit LAMB ("1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training with
LAMB's Convergence Speed", Li et al., arXiv:2104.06069, Algorithm 1): LAMB's arithmetic
(pure tensor functions, also used by the tests' references) and :class:`OneBitLamb`
(:mod:`.optimizer` has the stages and the choices shared with 1-bit Adam)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lowbit_strategy.algorithms.onebit import lamb_foreach
from lowbit_strategy.algorithms.onebit.optimizer import OneBitOptimizer
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
    clip: float | None = None,
) -> torch.Tensor:
    """LAMB's update direction u = m̂ / (sqrt(v̂) + eps) + λ·p (1-bit LAMB Eq. 2, with Adam's
    bias correction as in You et al.'s LAMB); ``clip``: the Adam part of every coordinate
    clamped to ``[-clip, clip]`` first (the compression stage's ``update_clip``)."""
    denom = (v.sqrt() / (1 - beta2**v_step) ** 0.5).add_(eps)
    u = (m / (1 - beta1**step)).div_(denom)
    if clip is not None:
        u.clamp_(-clip, clip)
    if weight_decay:
        u.add_(p, alpha=weight_decay)
    return u


def _lamb_update_(
    p: torch.Tensor,
    m: torch.Tensor,
    root: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    v_step: int,
) -> torch.Tensor:
    """:func:`lamb_update`'s floats from ``root = sqrt(v)`` (a temporary it may overwrite):
    the denominator formed in place, one temporary fewer."""
    denom = root.div_((1 - beta2**v_step) ** 0.5).add_(eps)
    u = (m / (1 - beta1**step)).div_(denom)
    if weight_decay:
        u.add_(p, alpha=weight_decay)
    return u


def trust_ratio(p: torch.Tensor, u: torch.Tensor, min_coeff: float, max_coeff: float) -> torch.Tensor:
    """LAMB's scaling coefficient c = clip(‖p‖ / ‖u‖, c_min, c_max) (1-bit LAMB Eq. 2, the
    clip applied to the whole ratio); 1 where either norm is 0 (a zero weight or a zero
    update: no ratio to speak of). A 0-d tensor: no host sync."""
    return ratio_of_norms(
        torch.linalg.vector_norm(p.float()), torch.linalg.vector_norm(u.float()), min_coeff, max_coeff
    )


def ratio_of_norms(wn: torch.Tensor, un: torch.Tensor, min_coeff: float, max_coeff: float) -> torch.Tensor:
    """:func:`trust_ratio` from the norms ``‖p‖``, ``‖u‖`` (0-d, or one entry per parameter:
    elementwise, the same floats)."""
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


class OneBitLamb(OneBitOptimizer):
    """1-bit LAMB (Algorithm 1): LAMB for ``freeze_step`` steps while keeping an EMA of each
    parameter's trust ratio; then the frozen variance, per-parameter momentum scaling
    coefficients (Sec. 4.3) around the fused compressed allreduce (Sec. 4.2), the gradient
    reconstructed from this and last step's momentum into a fresh variance, and the ratio r
    of frozen to fresh variance, clipped, scaling the frozen coefficient (lines 15-21).

    Memory: besides the state (m, v, the fresh variance), the compression stage keeps the
    frozen denominator ``sqrt(v̂) + eps`` and the mask ``v == 0`` (:meth:`_frozen`, not
    checkpointed), one more parameter-sized buffer and a byte per element: a sqrt, two
    passes and a comparison per element and step fewer (the batched step took the e2e
    GPT's compression step from 13.1 to 7.8 ms on CPU, ``benchmarks/results/codecs/optim_step.md``).

    Args (DeepSpeed ``OnebitLamb``'s names): params, lr, betas, eps, weight_decay (inside
    LAMB's update, scaled by the trust ratio), freeze_step, max_coeff / min_coeff (bounds of
    the warm-up trust ratio), coeff_beta (β3 of its EMA), factor_max / factor_min /
    factor_threshold (bounds and largest relative change per step of r). Not in DeepSpeed:
    ``update_clip`` and ``guard``, as :class:`~lowbit_strategy.OneBitAdam`'s (the Adam part
    ``m̂ / (sqrt(v̂_frozen) + eps)`` of the compressed update is bounded, then scaled by the
    frozen trust ratio as before).
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
        update_clip: float | str | None = "auto",
        guard: float | None = 1000.0,
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
            update_clip,
            guard,
        )
        self.coeff_beta, self.factor_max, self.factor_min = coeff_beta, factor_max, factor_min
        self.factor_threshold = factor_threshold

    def _state(self, p):
        state = super()._state(p)
        if "lamb_coeff_avg" not in state:
            state["lamb_coeff_avg"] = torch.zeros((), dtype=torch.float32, device=p.device)
        return state

    # ---- the step: the tensors per parameter or multi-tensor, the scalars batched -----------
    # On CPU each parameter's elementwise chain runs while its tensors are in cache (a
    # multi-tensor op per operation, streaming every parameter through each, measured
    # slower) and writes its temporaries into buffers it already has; on CUDA, where a
    # dozen launches per parameter dominate, the chains are multi-tensor ops
    # (:mod:`.lamb_foreach`, ``multi_tensor``). Either way the per-parameter scalars (norms,
    # trust ratios, r and its clips) are stacked and computed once for all parameters, and
    # the final scaling is one ``torch._foreach_*`` call. The per-parameter methods below
    # (_warmup, _compressed) are the same arithmetic in the plain form: what the tests hold
    # both to, bit for bit.
    def _warmup_all(self, active, step):
        """Algorithm 1 lines 1-2 (LAMB and the trust ratio's EMA) for every parameter with a
        gradient: :meth:`_warmup`'s floats. The tensor chains per parameter
        (:meth:`_warmup_chain`) or as multi-tensor ops (:mod:`.lamb_foreach`, on CUDA), then
        the trust ratios of a batch as one vector. The updates ``u`` of a group wait for its
        trust ratios: one parameter-sized temporary per parameter until the group's last
        step, as torch's multi-tensor optimizers hold."""
        for batch in _batches(active, lambda item: (id(item[0]), item[1].dtype, item[1].device)):
            group = batch[0][0]
            ps = [p for _, p in batch]
            states = [self._state(p) for p in ps]
            if self._multi_tensor_on(ps):
                ms, vs = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
                us, wn, un = lamb_foreach.warmup(ps, [p.grad for p in ps], ms, vs, group, step)
            else:
                us, wn, un = self._warmup_chain(group, ps, states, step)
            # (sharded: the whole parameters' norms, from the node's shards)
            wn_all, un_all = self._whole_norms(torch.stack(wn)), self._whole_norms(torch.stack(un))
            c = ratio_of_norms(wn_all, un_all, group["min_coeff"], group["max_coeff"])
            avgs = [s["lamb_coeff_avg"] for s in states]
            torch._foreach_lerp_(avgs, list(c.unbind()), 1 - self.coeff_beta)  # c_avg = β3·c_avg + (1-β3)·c
            _scaled_step_(ps, us, c, group["lr"])

    @staticmethod
    def _warmup_chain(group, ps, states, step):
        """Lines 1-2 up to the trust ratio, one parameter at a time (its chain in cache): the
        updates ``u`` and the norms ``‖p‖``, ``‖u‖`` (the denominator formed in the buffer of
        ``sqrt(v)``: one temporary fewer than :func:`lamb_update`)."""
        beta1, beta2 = group["betas"]
        us, wn, un = [], [], []
        for p, state in zip(ps, states):
            grad = p.grad
            m, v = state["exp_avg"], state["exp_avg_sq"]
            m.lerp_(grad, 1 - beta1)
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            u = _lamb_update_(
                p,
                m,
                v.sqrt(),
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                step=step,
                v_step=step,
            )
            us.append(u)
            wn.append(torch.linalg.vector_norm(p.float()))
            un.append(torch.linalg.vector_norm(u.float()))
        return us, wn, un

    def _compressed_all(self, items, step):
        """Algorithm 1 lines 14-21 for every parameter: :meth:`_compressed`'s floats, with the
        frozen denominator ``sqrt(v̂_frozen) + eps`` and the mask ``v == 0`` taken from
        :meth:`_frozen` (the per-parameter form computes them twice a step). The tensor chains
        per parameter (:meth:`_compressed_chain`) or as multi-tensor ops
        (:mod:`.lamb_foreach`, on CUDA), then r, its clips and the step for the batch at once;
        empty parameters (no maximum to take) one by one."""
        batched = []
        sharded = self._sharded  # every rank of the node batches every parameter: its statistics are the node's
        for group, p, mean in items:
            if p.numel() or sharded:
                batched.append((group, p, mean))
            else:
                self._compressed(group, p, mean, step)
        for batch in _batches(batched, lambda item: (id(item[0]), item[1].dtype, item[1].device)):
            group = batch[0][0]
            beta2, eps = group["betas"][1], group["eps"]
            ps, means = [p for _, p, _ in batch], [mean for _, _, mean in batch]
            states = [self._state(p) for p in ps]
            zeros, frozen = zip(*(self._frozen(s["exp_avg_sq"], beta2, eps) for s in states))
            chain = lamb_foreach.compressed if self._multi_tensor_on(ps) else self._compressed_chain
            us, rs = chain(
                ps, means, states, list(frozen), list(zeros), group, step, self.update_clip, self._note_updates
            )
            r = self._whole_max(torch.stack(rs).float())
            for state, ri in zip(states, r.unbind()):
                state["variance_ratio"] = ri
            r = clip_ratio(
                r,
                torch.stack([s["last_factor"] for s in states]),
                factor_min=self.factor_min,
                factor_max=self.factor_max,
                factor_threshold=self.factor_threshold,
            )
            for state, ri in zip(states, r.unbind()):
                state["last_factor"] = ri
            _scaled_step_(ps, us, r * torch.stack([s["lamb_coeff_freeze"] for s in states]), group["lr"])

    @staticmethod
    def _compressed_chain(ps, means, states, frozen, zeros, group, step, clip=None, note=None):
        """Lines 14-17 and 20, one parameter at a time, the temporaries reusing each other's
        buffers: the updates ``u`` and the unclipped ratios r (``-inf`` for an empty shard);
        ``clip``: the Adam part of ``u`` clamped to ``[-clip, clip]``; ``note(us)`` is given
        that part (the guard)."""
        beta1, beta2 = group["betas"]
        us, rs = [], []
        for p, mean, state, denom, zero in zip(ps, means, states, frozen, zeros):
            m = state["exp_avg"]
            new = mean.div(state["scaling_coeff"].to(mean.dtype)).to(m.dtype).masked_fill_(zero, 0)  # _masked
            fresh = state.get("exp_avg_sq_fresh")
            if fresh is None:  # as _track: start from the frozen variance
                fresh = state["exp_avg_sq_fresh"] = state["exp_avg_sq"].clone()
            # lines 15-17 (_track): the gradient the momenta imply, the fresh variance, r
            grad = m.mul(beta1)
            torch.sub(new, grad, out=grad).div_(1 - beta1)
            fresh.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            ratio = torch.sqrt(fresh, out=grad).div_((1 - beta2**step) ** 0.5).add_(group["eps"])
            quotient = torch.div(denom, ratio, out=ratio)
            rs.append(quotient.max() if quotient.numel() else quotient.new_full((), float("-inf")))
            m.copy_(new)
            # line 20: u = m̂ / (sqrt(v̂_frozen) + eps) + λ·p, in new's buffer
            u = torch.div(m, 1 - beta1**step, out=new).div_(denom)
            if clip is not None:
                u.clamp_(-clip, clip)
            if note is not None:
                note([u])
            if group["weight_decay"]:
                u.add_(p, alpha=group["weight_decay"])
            us.append(u)
        return us, rs

    # ---- the same, one parameter at a time --------------------------------------------------
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
        r = 1, and each parameter's momentum scaling coefficient ``mean_l(rms_l) / rms_l``
        (the mean over non-empty parameters; an empty one, which has no RMS and is in no
        bucket but may still step in one process, gets 1)."""
        params = [p for grp in self.param_groups for p in grp["params"]]
        states = [self._state(p) for p in params]
        whole = [(p, s) for p, s in zip(params, states) if self._global_numel(p)]
        sized = [s for _, s in whole]
        # (sharded: the whole parameters' norms from the node's shards, over their whole sizes)
        norms = [torch.linalg.vector_norm(s["exp_avg"].float()) for s in sized]
        norms = list(self._whole_norms(torch.stack(norms)).unbind()) if norms and self._sharded else norms
        rms = [n / self._global_numel(p) ** 0.5 for n, (p, _) in zip(norms, whole)]
        united = torch.stack(rms).mean() if rms else None
        for s in states:
            s["exp_avg_sq_fresh"] = s["exp_avg_sq"].clone()
            s["lamb_coeff_freeze"] = s["lamb_coeff_avg"] / (1 - self.coeff_beta**self.freeze_step)
            s["last_factor"] = torch.ones((), dtype=torch.float32, device=s["exp_avg"].device)
            s["scaling_coeff"] = torch.ones((), dtype=torch.float32, device=s["exp_avg"].device)
        for s, r in zip(sized, rms):
            s["scaling_coeff"] = torch.where(
                r > 0, united / r.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(r)
            )

    def _local_momentum(self, group, p, grad):
        # scaled before the compressed allreduce (Sec. 4.3), unscaled in _compressed
        return super()._local_momentum(group, p, grad).mul_(self.state[p]["scaling_coeff"].to(p.dtype))

    def _local_momentum_into(self, group, p, grad, a, b, out):
        super()._local_momentum_into(group, p, grad, a, b, out)
        out.mul_(self.state[p]["scaling_coeff"].to(p.dtype))

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
            weight_decay=0.0,
            step=step,
            v_step=self.freeze_step,
            clip=self.update_clip,
        )
        self._note_updates([u])
        if group["weight_decay"]:  # (lamb_update's own last operation)
            u.add_(p, alpha=group["weight_decay"])
        p.sub_(u.mul_((r * state["lamb_coeff_freeze"]).to(u.dtype) * group["lr"]))  # lines 20-21


def _batches(items: list, key) -> list[list]:
    """``items`` split by ``key(item)`` (a parameter group and dtypes: what one multi-tensor
    call may mix), in first-seen order."""
    out: dict = {}
    for item in items:
        out.setdefault(key(item), []).append(item)
    return list(out.values())


def _scaled_step_(ps: list[torch.Tensor], us: list[torch.Tensor], coeff: torch.Tensor, lr: float) -> None:
    """``p -= u · (coeff_p · lr)`` for every parameter, as the per-parameter step computes it
    (the coefficient cast to u's dtype, times lr, then the product): ``coeff`` one entry per
    parameter."""
    torch._foreach_mul_(us, list((coeff.to(us[0].dtype) * lr).unbind()))
    torch._foreach_sub_(ps, us)
