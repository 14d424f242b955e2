"""The per-parameter arithmetic of 1-bit Adam and 1-bit LAMB, shared by every path.

Pure tensor functions: no process group, no optimizer state dict. The optimizers call them
the same way whether the momentum came from a compressed allreduce, from the DDP hook's
averaged gradient or from a single process, and the tests call them to build references.

Papers: "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed" (Tang et al., arXiv:2102.02888) and "1-bit LAMB: Communication Efficient
Large-Scale Large-Batch Training with LAMB's Convergence Speed" (Li et al.,
arXiv:2104.06069), Algorithm 1.
"""
from __future__ import annotations

import torch


def adamw_(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, beta1: float,
           beta2: float, eps: float, weight_decay: float, step: int) -> None:
    """One ``torch.optim.AdamW`` step on ``p`` (decoupled weight decay, bias correction), with
    the same operations in the same order as torch's single-tensor implementation, so the
    warm-up stage equals DDP + AdamW bit for bit."""
    p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    adam_apply_(p, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step, v_step=step)


def adam_apply_(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, beta1: float, beta2: float,
                eps: float, step: int, v_step: int) -> None:
    """``p -= lr · m̂ / (sqrt(v̂) + eps)`` with m̂ = m / (1 - β1^step) and v̂ = v / (1 - β2^v_step).

    In the compression stage ``v`` is the variance frozen at ``v_step = freeze_step`` (1-bit
    Adam Algorithm 1: the frozen variance preconditions momentum SGD), so its bias correction
    stays the one it had when it was frozen, and the first compressed step continues the
    warm-up's arithmetic without a jump."""
    denom = (v.sqrt() / (1 - beta2 ** v_step) ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-(lr / (1 - beta1 ** step)))


def lamb_update(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, beta1: float, beta2: float, eps: float,
                weight_decay: float, step: int, v_step: int) -> torch.Tensor:
    """LAMB's update direction u = m̂ / (sqrt(v̂) + eps) + λ·p (1-bit LAMB Eq. 2, with Adam's
    bias correction as in You et al.'s LAMB)."""
    denom = (v.sqrt() / (1 - beta2 ** v_step) ** 0.5).add_(eps)
    u = (m / (1 - beta1 ** step)).div_(denom)
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


def variance_ratio(v_frozen: torch.Tensor, v_fresh: torch.Tensor, *, beta2: float, eps: float, step: int,
                   freeze_step: int) -> torch.Tensor:
    """1-bit LAMB's scaling ratio r_t before clipping (Algorithm 1 line 17), as the largest
    ratio of Adam *denominators*, ``max((sqrt(v̂_frozen) + eps) / (sqrt(v̂_fresh) + eps))``.

    The paper writes ``‖v_frozen / v_fresh‖_∞``, a ratio of variances; we take the ratio of
    their square roots plus eps, as DeepSpeed's ``OnebitLamb`` does: it is what the frozen
    variance actually changes in the update (m / (sqrt(v) + eps)), it stays finite where the
    fresh variance is 0, and the defaults factor_min=0.5, factor_max=4 were tuned for it.
    """
    frozen = (v_frozen.sqrt() / (1 - beta2 ** freeze_step) ** 0.5).add_(eps)
    fresh = (v_fresh.sqrt() / (1 - beta2 ** step) ** 0.5).add_(eps)
    if frozen.numel() == 0:
        return torch.ones((), dtype=frozen.dtype, device=frozen.device)
    return (frozen / fresh).max()


def clip_ratio(r: torch.Tensor, last: torch.Tensor, *, factor_min: float, factor_max: float,
               factor_threshold: float) -> torch.Tensor:
    """Algorithm 1 lines 18-19, in the paper's order: first within ±``factor_threshold`` of
    the previous ratio, then within [``factor_min``, ``factor_max``].

    DeepSpeed clips in the other order (bounds first, then the rate); the paper's order
    makes the bounds hard limits, which is what a user setting ``factor_max`` expects."""
    r = torch.minimum(torch.maximum(r, last * (1 - factor_threshold)), last * (1 + factor_threshold))
    return r.clamp(factor_min, factor_max)
