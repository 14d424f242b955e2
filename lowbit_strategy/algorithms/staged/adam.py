"""Adam's per-parameter arithmetic, shared by every staged optimizer (1-bit Adam / LAMB and
TurboQuant-Adam): the warm-up stage and every update with a given variance.

Pure tensor functions: no process group, no optimizer state dict. The optimizers call them
the same way whether the momentum came from a compressed collective, from the DDP hook's
averaged gradient or from a single process, and the tests call them to build references.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def adamw_(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """One ``torch.optim.AdamW`` step on ``p`` (decoupled weight decay, bias correction), with
    the same operations in the same order as torch's single-tensor implementation, so the
    warm-up stage equals DDP + AdamW bit for bit."""
    p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    adam_apply_(p, m, v, lr=lr, beta1=beta1, beta2=beta2, eps=eps, step=step, v_step=step)


def adam_apply_(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    step: int,
    v_step: int,
    clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``p -= lr · m̂ / (sqrt(v̂) + eps)`` with m̂ = m / (1 - β1^step) and v̂ = v / (1 - β2^v_step);
    returns the momentum used (``m``, or its clipped copy) and the denominator.

    In 1-bit Adam's compression stage ``v`` is the variance frozen at ``v_step =
    freeze_step`` ("1-bit Adam", Tang et al., arXiv:2102.02888, Algorithm 1: the frozen
    variance preconditions momentum SGD), so its bias correction stays the one it had when
    it was frozen, and the first compressed step continues the warm-up's arithmetic without
    a jump. TurboQuant-Adam passes its live variance with ``v_step = step``.

    ``clip``: every coordinate's ``|m̂ / (sqrt(v̂) + eps)|`` at most ``clip`` (its step at most
    ``lr · clip``; :func:`clip_momentum`). None (the warm-up, TurboQuant): no bound, the same
    operations as without it."""
    denom = (v.sqrt() / (1 - beta2**v_step) ** 0.5).add_(eps)
    if clip is not None:
        m = clip_momentum(m, denom, clip * (1 - beta1**step))
    p.addcdiv_(m, denom, value=-(lr / (1 - beta1**step)))
    return m, denom


def clip_momentum(m: torch.Tensor, denom: torch.Tensor, bound: float) -> torch.Tensor:
    """``m`` clamped to ``[-bound·denom, bound·denom]`` per coordinate, in a new tensor: with
    ``bound = clip · (1 - β1^step)`` the direction ``m̂ / denom`` is at most ``clip`` in size.
    One multiplication, then selections, so :func:`clip_momentum_foreach` (the same
    multiplication, then clamp_min / clamp_max) gives the same floats."""
    lim = denom * bound
    return torch.clamp(m, min=-lim, max=lim)


def clip_momentum_foreach(
    ms: Sequence[torch.Tensor], denoms: Sequence[torch.Tensor], bound: float
) -> list[torch.Tensor]:
    """:func:`clip_momentum` on lists of tensors (multi-tensor ops), bit for bit."""
    lims = torch._foreach_mul(list(denoms), bound)
    out = torch._foreach_clamp_min(list(ms), torch._foreach_neg(lims))
    torch._foreach_clamp_max_(out, lims)
    return list(out)


def adamw_foreach_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """:func:`adamw_` on lists of tensors, one multi-tensor (``torch._foreach_*``) call per
    operation instead of one Python call per parameter and operation: the operations and
    their order are :func:`adamw_`'s (and torch's multi-tensor AdamW's). On CPU each
    ``_foreach_`` op runs the single-tensor kernel on every tensor, so the result is
    :func:`adamw_`'s, i.e. ``torch.optim.AdamW``'s (CPU's default, ``foreach=False``), bit
    for bit; on CUDA these are the operations of torch's multi-tensor AdamW, its default
    there (checked bit for bit on CPU only)."""
    if not params:
        return
    torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(ms, grads, 1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, (1 - beta2**step) ** 0.5)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, ms, denom, value=-(lr / (1 - beta1**step)))
