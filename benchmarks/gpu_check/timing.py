"""Timing for parts 2 and 4: CUDA events on a GPU (the kernels' time on the stream, after a
warm-up that compiles kernels and grows the allocator), the wall clock on a CPU; the median
of a few calls."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def median_s(fn: Callable[[], object], device: torch.device, repeat: int = 5, warmup: int = 1) -> float:
    """Median seconds of ``repeat`` calls of ``fn`` after ``warmup`` calls. On CUDA each call
    is bracketed by two events on the current stream (so a call that syncs the host counts
    its idle gaps too, as a training step would wait for them)."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_issue_s(fn: Callable[[], object], repeat: int = 3) -> float:
    """Median host seconds to *issue* ``fn`` (no synchronization after it). On a GPU, when
    this is close to :func:`median_s`'s event time the call is bound by the host (Python and
    torch's dispatch, one kernel launch per op), not by the GPU: fewer calls would make it
    faster, faster kernels would not. On a CPU it is the call's time."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def op_count(fn: Callable[[], object]) -> int:
    """The torch operator calls one call of ``fn`` dispatches (views and metadata included;
    Triton kernels are not torch operators and are not counted)."""
    with _OpCounter() as counter:
        fn()
    return counter.count


def copy_s(numel: int, device: torch.device, repeat: int = 5) -> float:
    """Median seconds of a device-to-device copy of ``numel`` float32 (``dst.copy_(src)``)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    return median_s(lambda: dst.copy_(src), device, repeat)


@contextlib.contextmanager
def cpu_rank_threads(cpu: bool) -> Iterator[None]:
    """One torch thread while timing on a CPU (``cpu``), as a CPU rank runs: more threads on a
    busy machine spin and time 10-300x slower (:mod:`lowbit_strategy.plan.measure`)."""
    threads = torch.get_num_threads()
    if cpu:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
