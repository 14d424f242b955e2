"""Full-precision allreduce: the uncompressed baseline behind the same interface.

What DDP does today (fp32), or with ``fp16_compress_hook``-style casting (bf16/fp16): the
sum over ranks of ``x``, sent as ``wire_dtype``. It is the reference every compressed
collective is compared with, and Lion Cub's ``fp32`` / ``bf16`` modes.
"""
from __future__ import annotations

import torch

from lowbit_strategy.collectives import group as g

WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def full_allreduce(
    x: torch.Tensor,
    group=None,
    *,
    wire_dtype: torch.dtype = torch.float32,
    check: bool = False,
    traffic=None,
) -> torch.Tensor:
    """Sum of ``x`` over ranks, sent as ``wire_dtype``; returned in ``x``'s dtype and shape.

    ``x`` itself is not modified.
    """
    return full_allreduce_start(x, group, wire_dtype=wire_dtype, check=check, traffic=traffic).wait()


def full_allreduce_start(
    x: torch.Tensor,
    group=None,
    *,
    wire_dtype: torch.dtype = torch.float32,
    check: bool = False,
    traffic=None,
) -> g.Pending:
    """:func:`full_allreduce` launched asynchronously; ``.wait()`` returns the sum."""
    if not x.dtype.is_floating_point:
        raise TypeError(f"full_allreduce needs a floating-point tensor, got dtype {x.dtype}")
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}, got {wire_dtype}")
    if x.numel() == 0:
        raise ValueError("full_allreduce got an empty tensor")
    if check:
        g.check_consistent(x, group, "full_allreduce", None, traffic)
    buf = x.reshape(-1).to(wire_dtype, copy=True)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[wire_dtype]
    fut = g.all_reduce_sum_async(buf, group, f"full.allreduce.{name}", traffic)
    return g.Pending(fut, lambda: buf.to(x.dtype).view(x.shape))
