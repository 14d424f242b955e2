"""Codec timings every rank agrees on, for the ``auto`` plans (Lion Cub's mode, TurboQuant's form).

An ``auto`` plan weighs the α–β wire time of each candidate against its codec time on this
machine, and every rank must choose alike (a rank that planned another mode would send other
bytes and hang or corrupt the collective). So the timing is a collective:

* every rank measures at the same moment, right after a barrier: ranks that share a
  machine's cores (several GPUs' host threads, or CPU ranks) then measure the codec as it
  will run, sharing them. Four CPU ranks on two cores measured ~2× a lone rank's time, and a
  plan made with the lone rank's figure chose a codec 0.71× as fast as DDP + AdamW;
* the slowest rank's figures are kept (a MAX allreduce): a collective ends when its slowest
  rank does, so that rank's codec time is the one the step waits for.

:func:`median_seconds` is the timing loop both measurements use (a warm-up call, then the
median of ``repeat`` calls, the device synchronized around each on CUDA) and
:func:`sample_values` the values they time, drawn from a private generator: a measurement
that drew from torch's global RNG would shift every later draw from it (dropout masks, a
``RandomSampler`` without a generator, the user's own ``torch.rand``), so a run with ``auto``
and one with the plan ``auto`` chose would not train alike.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

import torch

from lowbit_strategy.collectives import group as g

__all__ = ["agreed_slowest", "median_seconds", "sample_values"]


def sample_values(*shape: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Standard-normal values of ``shape`` on ``device`` for a timing measurement, from a
    generator of its own (seed 0): torch's global RNG is left as it was (see the module doc)."""
    generator = torch.Generator(device=device).manual_seed(0)
    return torch.randn(*shape, generator=generator, device=device)


def median_seconds(fn: Callable[[], object], repeat: int, device: torch.device | str = "cpu") -> float:
    """The median wall time of ``repeat`` calls of ``fn`` after one warm-up call (which
    builds tables, compiles kernels and grows the allocator's heap). On CUDA the device is
    synchronized before and after each call, so the kernels' time is counted, not their
    queueing."""
    cuda = torch.device(device).type == "cuda"
    fn()
    times = []
    for _ in range(max(1, repeat)):
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def agreed_slowest(
    measure: Callable[[], Mapping[str, float]],
    group,
    op: str,
    traffic=None,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """``measure()`` run by every rank of ``group`` at once, and the slowest rank's figure of
    each key on every rank (a collective: every rank calls it, with the same keys in the same
    order). The barrier is a one-element SUM allreduce: on gloo it returns only when every rank
    has entered it; on NCCL it is queued on the current stream, and the measurement's first
    device synchronization (:func:`median_seconds`) waits for it. The figures travel as
    float64 on ``device`` (NCCL: on the GPU).
    Recorded in ``traffic`` as ``<op>.start`` and ``<op>``."""
    start = torch.zeros(1, dtype=torch.float64, device=device)
    g.all_reduce_sum(start, group, f"{op}.start", traffic)
    mine = dict(measure())
    times = torch.tensor(list(mine.values()), dtype=torch.float64, device=device)
    g.all_reduce_max(times, group, op, traffic)
    return dict(zip(mine, times.tolist()))
