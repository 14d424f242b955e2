"""Flat buckets over many tensors: one collective per bucket instead of one per tensor.

A bucket is a contiguous run of tensors whose elements are concatenated into one flat
buffer. The plan depends only on the tensors' order and sizes, so every rank computes the
same plan without talking. Tensors are planned in the order given; callers that want the
first bucket ready first during backward pass them last-layer first.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lowbit_strategy import _moved


def partition(numels: Sequence[int], bucket_numel: int) -> list[range]:
    """Greedy contiguous buckets of at most ``bucket_numel`` elements (a larger tensor
    gets a bucket of its own). Returns index ranges into ``numels``."""
    if bucket_numel < 1:
        raise ValueError(f"bucket_numel must be >= 1, got {bucket_numel}")
    out: list[range] = []
    start, filled = 0, 0
    for i, n in enumerate(numels):
        if filled and filled + n > bucket_numel:
            out.append(range(start, i))
            start, filled = i, 0
        filled += n
    if len(numels) > start:
        out.append(range(start, len(numels)))
    return out


def bucket_numel(size_mb: float, element_size: int = 4) -> int:
    """Elements of ``element_size`` bytes that fill ``size_mb`` MiB."""
    return max(1, int(size_mb * 2**20) // element_size)


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat float buffer holding ``tensors`` back to back."""
    return torch.cat([t.reshape(-1) for t in tensors])


def flatten_range(tensors: Sequence[torch.Tensor], lo: int, hi: int, *, out: torch.Tensor) -> torch.Tensor:
    """Elements ``[lo, hi)`` of ``tensors`` laid end to end (as :func:`flatten` would place
    them), written into ``out`` (``hi - lo`` elements, its dtype: 16-bit tensors convert
    exactly into float32): one read of the part needed, no temporary. Returns ``out``."""
    pieces, start = [], 0
    for t in tensors:
        a, b = max(lo, start), min(hi, start + t.numel())
        if a < b:
            pieces.append(t.reshape(-1)[a - start : b - start])
        start += t.numel()
    if all(t.dtype == out.dtype for t in pieces):
        return torch.cat(pieces, out=out)
    at = 0
    for t in pieces:
        out[at : at + t.numel()].copy_(t)
        at += t.numel()
    return out


def unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``like`` (inverse of :func:`flatten`)."""
    views = torch.split(flat, [t.numel() for t in like])
    return [v.view(t.shape) for v, t in zip(views, like)]


#: ``plan`` was renamed ``partition`` (0.3: "plan" names the planner); still served, with a warning
__getattr__ = _moved.attribute_aliases(__name__, {"plan": "lowbit_strategy.buckets.partition"})
