"""1-bit LAMB's per-parameter tensor chains as multi-tensor (``torch._foreach_*``) ops: the
form :class:`~.lamb.OneBitLamb` runs on CUDA parameters (``multi_tensor``).

On a GPU the per-parameter chains are launch-bound: about a dozen small kernels per
parameter and step (an H100 spent 44.5 ms per compression step on GPT-2 small's 148
parameters, where the bytes take well under a millisecond). Here each operation is one
multi-tensor call over a batch (a parameter group, one dtype, one device), plus the few
operations with a per-parameter 0-d operand (the momentum scaling coefficient, the mask).

The same operations on the same values in the same order as
:meth:`~.lamb.OneBitLamb._warmup_chain` and :meth:`~.lamb.OneBitLamb._compressed_chain`.
On CPU a ``_foreach_`` op runs the single-tensor kernel on each tensor, so the two forms give
the same floats (the tests hold them to each other bit for bit). On CUDA the elementwise
kernels compute the same IEEE operations; the warm-up's norms come from
``torch._foreach_norm``, whose summation order differs from ``vector_norm``'s, so there the
trust ratios agree within rounding, not bit for bit. Every rank runs the same form, so the
replicas stay identical either way. The price is memory: the batch's temporaries exist at
once (up to two parameter-sized buffers per parameter, as torch's own multi-tensor AdamW
holds), where the per-parameter chain holds one parameter's at a time.
"""

from __future__ import annotations

import torch


def _maxima(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The maximum of each tensor (0-d); ``-inf`` for an empty one (a shard holding no rows of
    its parameter, which the node's maximum then ignores), as the per-parameter chain takes it."""
    full = [t for t in tensors if t.numel()]
    found = iter(torch._foreach_max(full) if full and hasattr(torch, "_foreach_max") else [t.max() for t in full])
    return [next(found) if t.numel() else t.new_full((), float("-inf")) for t in tensors]


def warmup(
    ps: list[torch.Tensor],
    grads: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    group: dict,
    step: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Algorithm 1 lines 1-2 up to the trust ratio: the moments updated in place and, per
    parameter, LAMB's update ``u`` and the norms ``‖p‖``, ``‖u‖`` (float32, 0-d)."""
    beta1, beta2 = group["betas"]
    torch._foreach_lerp_(ms, grads, 1 - beta1)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
    denom = torch._foreach_sqrt(vs)  # lamb._lamb_update_: sqrt(v) / sqrt(1 - β2^t) + eps
    torch._foreach_div_(denom, (1 - beta2**step) ** 0.5)
    torch._foreach_add_(denom, group["eps"])
    us = list(torch._foreach_div(ms, 1 - beta1**step))
    torch._foreach_div_(us, denom)
    del denom
    if group["weight_decay"]:
        torch._foreach_add_(us, ps, alpha=group["weight_decay"])
    return us, _norms(ps), _norms(us)


def _norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``vector_norm(t.float())`` of each tensor (0-d float32; ``float()`` is the tensor
    itself when it is float32 already)."""
    return list(torch._foreach_norm([t.float() for t in tensors]))


def compressed(
    ps: list[torch.Tensor],
    means: list[torch.Tensor],
    states: list[dict],
    frozen: list[torch.Tensor],
    zeros: list[torch.Tensor],
    group: dict,
    step: int,
    clip: float | None = None,
    note=None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Algorithm 1 lines 14-17 and 20: the momentum set to the (unscaled, masked) mean, the
    fresh variance updated from the gradient the momenta imply, and per parameter the update
    ``u = m̂ / (sqrt(v̂_frozen) + eps) + λ·p`` and the unclipped ratio r (0-d, before the
    node's maximum). ``frozen``/``zeros``: each parameter's ``sqrt(v̂_frozen) + eps`` and
    ``v == 0`` (:meth:`~.lamb.OneBitLamb._frozen`); ``clip``, ``note``: as
    :meth:`~.lamb.OneBitLamb._compressed_chain`'s."""
    beta1, beta2 = group["betas"]
    ms = [s["exp_avg"] for s in states]
    # the mean momentum, unscaled (Sec. 4.3) and masked: a per-parameter 0-d divisor and mask
    news = [
        mean.div(s["scaling_coeff"].to(mean.dtype)).to(m.dtype).masked_fill_(zero, 0)
        for mean, s, m, zero in zip(means, states, ms, zeros)
    ]
    freshs = []
    for s in states:
        if s.get("exp_avg_sq_fresh") is None:  # as _track: start from the frozen variance
            s["exp_avg_sq_fresh"] = s["exp_avg_sq"].clone()
        freshs.append(s["exp_avg_sq_fresh"])
    # lines 15-17: grad = (new - β1·m) / (1 - β1), summed as -(β1·m) + new (negation and
    # IEEE addition's commutativity are exact: the same floats as new - β1·m)
    grads = torch._foreach_mul(ms, -beta1)
    torch._foreach_add_(grads, news)
    torch._foreach_div_(grads, 1 - beta1)
    torch._foreach_mul_(freshs, beta2)
    torch._foreach_addcmul_(freshs, grads, grads, value=1 - beta2)
    del grads
    ratio = torch._foreach_sqrt(freshs)
    torch._foreach_div_(ratio, (1 - beta2**step) ** 0.5)
    torch._foreach_add_(ratio, group["eps"])
    quotients = list(torch._foreach_div(frozen, ratio))
    del ratio
    rs = _maxima(quotients)
    del quotients
    torch._foreach_copy_(ms, news)
    # line 20: u = m̂ / (sqrt(v̂_frozen) + eps) + λ·p, in the buffers of the new momenta
    torch._foreach_div_(news, 1 - beta1**step)
    torch._foreach_div_(news, frozen)
    if clip is not None:
        torch._foreach_clamp_min_(news, -clip)
        torch._foreach_clamp_max_(news, clip)
    if note is not None:
        note(news)
    if group["weight_decay"]:
        torch._foreach_add_(news, ps, alpha=group["weight_decay"])
    return news, rs
