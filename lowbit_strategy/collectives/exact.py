"""Exact (uncompressed) allreduces: the fp32 / bf16 baseline behind the same interface, and
DDP's own mean of a gradient bucket.

What DDP does today (fp32), or with ``fp16_compress_hook``-style casting (bf16/fp16): the sum
over ranks of ``x``, sent as ``wire_dtype``. The warm-ups and fp32 fallbacks of every
algorithm run these (Lion Cub's ``fp32`` / ``bf16`` modes, the staged optimizers' exact stage,
BitDP's full-precision steps); the compressed collectives are compared with them. The
single-process oracles are in :mod:`.reference`.
"""

from __future__ import annotations

import torch

from lowbit_strategy.codecs.reduce import nonfinite_flag
from lowbit_strategy.collectives import chain
from lowbit_strategy.collectives import group as g

WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: each wire dtype's name in configs and traffic records
WIRE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
#: the wires an uncompressed exchange may send (a fallback, BitDP's and Lion Cub's first steps)
EXACT_WIRES = ("bf16", "fp32")
#: what ``LowBitConfig.warmup_wire`` may name: an exact wire, or ``int2`` (the staged
#: optimizers' warm-ups in BitDP's 2-bit codes with error feedback, every other uncompressed
#: exchange in bf16: :func:`exact_wire`)
WARMUP_WIRES = ("bf16", "fp32", "int2")


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

    def validate() -> None:
        if not x.dtype.is_floating_point:
            raise TypeError(f"full_allreduce needs a floating-point tensor, got dtype {x.dtype}")
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}, got {wire_dtype}")
        if x.numel() == 0:
            raise ValueError("full_allreduce got an empty tensor")

    g.validated(validate, x, group, "full_allreduce", check, traffic)  # with check, a bad rank never raises alone
    buf = x.reshape(-1).to(wire_dtype, copy=True)
    name = WIRE_NAMES[wire_dtype]
    fut = g.all_reduce_sum_async(buf, group, f"full.allreduce.{name}", traffic)
    return g.Pending(fut, lambda: buf.to(x.dtype).view(x.shape))


def mean_allreduce_async(
    buf: torch.Tensor, group, op: str, traffic=None, wire_dtype: torch.dtype = torch.float32
) -> torch.futures.Future:
    """DDP's own averaging of a gradient bucket, in place and bit for bit. ``float32`` (DDP
    without a hook): its reducer scales each gradient by 1/P (a multiply, not a divide: they
    differ in the last bit when P is not a power of two) before the SUM allreduce, so fp16
    does not overflow. ``bfloat16`` / ``float16``: what torch's ``bf16_compress_hook`` /
    ``fp16_compress_hook`` compute (the bucket cast to the wire dtype, divided by P, summed
    in it, copied back): half the bytes, the same bits as DDP registered with that hook. The
    future resolves to ``buf`` and is chained (``then``) from the allreduce's own future, as
    DDP's own hooks do: a communication hook returns it, and DDP's wait on it is ordered
    after the data. With one worker in ``group`` nothing crosses the wire, so nothing is
    rounded to it (a node alone across nodes keeps its exact mean)."""
    if wire_dtype == buf.dtype or g.world_size(group) == 1:
        buf.mul_(1.0 / g.world_size(group))
        return chain.then(g.all_reduce_sum_async(buf, group, op, traffic), lambda _: buf)
    wire = buf.to(wire_dtype).div_(g.world_size(group))
    return chain.then(g.all_reduce_sum_async(wire, group, op, traffic), lambda _: buf.copy_(wire))


def exact_wire(warmup_wire: str) -> str:
    """The exact wire an uncompressed exchange sends under ``LowBitConfig.warmup_wire``:
    itself, or ``bf16`` for ``int2`` (a fallback or a first step is not coded)."""
    return warmup_wire if warmup_wire in EXACT_WIRES else "bf16"


def wire_dtype_of(name: str) -> torch.dtype:
    """``"fp32"`` / ``"bf16"`` / ``"fp16"`` (a config's wire name) as a dtype."""
    return next(dtype for dtype, known in WIRE_NAMES.items() if known == name)


class ExactMean:
    """:func:`mean_allreduce_async` as a :class:`~.group.Flagging` collective: DDP's mean of
    a flat buffer, in place, sent as ``wire_dtype``, for a staged optimizer's ``fp32`` /
    ``bf16`` form (the fallback when compressing would not pay). ``.gather()`` is itself (one phase); ``.wait()``
    returns the mean after the allreduce's own wait; ``.nonfinite()`` after it: whether
    the mean holds a NaN/Inf, the same verdict on every rank (every rank holds the same
    sum, and a non-finite input on any rank makes it non-finite)."""

    def __init__(self, buf: torch.Tensor, group, op: str, traffic=None, wire_dtype: torch.dtype = torch.float32):
        self._buf = buf
        self._future = mean_allreduce_async(buf, group, op, traffic, wire_dtype)
        self._done = False

    def gather(self) -> ExactMean:
        return self

    def wait(self) -> torch.Tensor:
        if not self._done:
            self._future.wait()  # re-raises a failed collective; orders the reads after it
            self._done = True
        return self._buf

    def nonfinite(self) -> torch.Tensor:
        if not self._done:
            raise RuntimeError("ExactMean.nonfinite() needs the collective's result: call wait() first")
        return nonfinite_flag(self._buf)
