"""The sum over ranks: one fixed order, a few kernels whatever the number of ranks.

Every collective that decodes the P ranks' payloads and averages them on every rank needs
the same float32 result on every rank, so the order of the additions is part of its
definition. Summing rank after rank (``((x_0 + x_1) + x_2) + …``) takes P − 1 kernel
launches per bucket, tens of thousands per step on a GPU at P = 64; no torch reduction
reproduces that order (``torch.sum`` over a dimension uses several accumulators, and a
different scheme on CUDA). :func:`rank_sum` adds in a fixed pairwise tree instead:

    level 1: (x_0 + x_1), (x_2 + x_3), …   an odd last row is carried up unchanged
    level 2: the same on the level-1 sums, and so on until one row is left

``ceil(log2 P)`` additions (plus a concatenation at levels with an odd count), each one
elementwise over all the pairs at once, so every backend (torch on CPU or CUDA, a Triton
kernel) computes the same bits. For P ≤ 3 it is exactly rank order: ``x_0 + x_1`` and
``(x_0 + x_1) + x_2``. Pure: no process group.
"""

from __future__ import annotations

import torch


def rank_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over its first dimension (one row per rank, in rank order) in the
    pairwise order of the module docstring; ``x`` is not modified (a new tensor, or a view
    of ``x[0]`` when there is one row)."""
    if x.dim() == 0 or x.shape[0] == 0:
        raise ValueError(f"rank_sum needs at least one row, got shape {tuple(x.shape)}")
    while x.shape[0] > 1:
        pairs = x.shape[0] // 2
        level = x[0 : 2 * pairs : 2] + x[1 : 2 * pairs : 2]
        x = torch.cat([level, x[-1:]]) if x.shape[0] % 2 else level
    return x[0]


def divide(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x / k`` (float), correctly rounded on every device: the weights ``s_r / P`` of the
    rank means above. torch on CUDA divides by a Python (CPU) scalar as ``x · (1/k)``, which
    can be one ulp off the true quotient where ``1/k`` is inexact (P = 5, say); a divisor
    tensor on ``x``'s own device takes the IEEE division on both CPU and CUDA, so a CUDA run
    and its CPU oracle compute the same bits."""
    return x / torch.full((), k, dtype=x.dtype, device=x.device)


def nonfinite_flag(*tensors: torch.Tensor) -> torch.Tensor:
    """Whether any element of ``tensors`` is NaN or ±Inf, as a 0-d bool tensor on their device
    (no host read): the step's device-side non-finite verdict.

    One ``aminmax`` per tensor (a single streaming reduction: min and max propagate NaN, and
    are ±Inf exactly when an infinity is present), then one small ``isfinite``: the same
    answer as ``~isfinite(t).all()``, which builds two n-element masks (on one CPU thread 2.2 ms
    per 2^20 float32 elements against 0.11 ms). Empty tensors hold nothing non-finite."""
    wide = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32  # (exact: no overflow)
    ends = [x.to(wide) for t in tensors if t.numel() for x in torch.aminmax(t.detach().reshape(-1))]
    if not ends:
        device = tensors[0].device if tensors else "cpu"
        return torch.zeros((), dtype=torch.bool, device=device)
    return ~torch.isfinite(torch.stack(ends)).all()
