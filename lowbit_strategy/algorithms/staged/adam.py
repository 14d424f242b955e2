"""Adam's per-parameter arithmetic, shared by every staged optimizer (1-bit Adam / LAMB and
TurboQuant-Adam): the warm-up stage and every update with a given variance.

Pure tensor functions: no process group, no optimizer state dict. The optimizers call them
the same way whether the momentum came from a compressed collective, from the DDP hook's
averaged gradient or from a single process, and the tests call them to build references.
"""

from __future__ import annotations

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
) -> torch.Tensor:
    """``p -= lr · m̂ / (sqrt(v̂) + eps)`` with m̂ = m / (1 - β1^step) and v̂ = v / (1 - β2^v_step)
    (torch's AdamW operations: ``addcdiv_``); returns the denominator. The warm-up stage and
    TurboQuant-Adam pass their live variance with ``v_step = step``. (1-bit Adam's compression
    stage divides by its frozen variance's denominator, kept: :mod:`..onebit.adam`.)"""
    denom = adam_denominator(v, beta2=beta2, eps=eps, v_step=v_step)
    p.addcdiv_(m, denom, value=-(lr / (1 - beta1**step)))
    return denom


def adam_denominator(v: torch.Tensor, *, beta2: float, eps: float, v_step: int) -> torch.Tensor:
    """Adam's denominator ``sqrt(v̂) + eps``, ``v̂ = v / (1 - β2^v_step)``, as
    :func:`adam_apply_` computes it (a new tensor). For 1-bit Adam's frozen variance,
    ``v_step = freeze_step``: its bias correction stays the one it had when frozen ("1-bit
    Adam", Tang et al., arXiv:2102.02888, Algorithm 1), so the first compressed step
    continues the warm-up's arithmetic without a jump."""
    return (v.sqrt() / (1 - beta2**v_step) ** 0.5).add_(eps)


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
