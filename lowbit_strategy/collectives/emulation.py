"""NCCL's completion semantics on CPU ranks over gloo: a test mode for the collectives.

On NCCL a collective's future is complete as soon as the operation is *queued*; its output
is written later, by kernels on NCCL's own stream. Only two things are ordered after the
data: ``wait()`` on that future (it makes the current stream wait for the collective), and
a callback chained from that very future with ``then`` (its kernels run after it).
``Future.value()`` never synchronizes streams, and ``torch.futures.collect_all`` returns a
future with no devices whose callbacks run at once. Gloo completes a future only when its
data is there, which hides every read that comes too early.

With ``LOWBIT_EMULATE_NCCL=1`` in the environment (read when this module is first imported)
the async launches of :mod:`.group` reproduce NCCL's rules on CPU:

* the real gloo collective writes a private buffer, and the caller's output buffer holds
  *poison* (NaN for floating point, ``0xA5`` bytes, large integers) until the data **lands**;
* the returned future is complete at once, its value the (poisoned) output buffer;
* ``wait()`` lands the data, then returns;
* ``then(cb)`` and ``add_done_callback(cb)`` run ``cb`` once the gloo collective has
  finished, after landing (as the stream would order the callback's kernels); the future
  ``then`` returns completes when ``cb`` has run;
* ``value()`` returns at once, without landing;
* ``torch.futures.collect_all`` completes at once, with nothing landed.

So a result decoded without its own ``wait()`` or a ``then`` chained from its collective
decodes poison, and differs from the gloo run; code that follows the rules gives the same
bits in both modes. The blocking collectives (no ``async_op``) are left alone: NCCL orders
the current stream after them. One more strictness: a future handed to DDP from a
communication hook must be chained from the collective with ``then`` (DDP's C++ waits on it
without landing here), which is what PyTorch's own hooks do.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from lowbit_strategy.collectives import chain

#: whether the emulation is on in this process (``LOWBIT_EMULATE_NCCL=1`` at import)
ACTIVE = os.environ.get("LOWBIT_EMULATE_NCCL", "") == "1"

#: the environment variable that switches the emulation on (not a LowBitConfig field)
ENV = "LOWBIT_EMULATE_NCCL"


def poison(t: torch.Tensor) -> None:
    """Overwrite ``t`` with values no collective produces by accident: NaN, ``0xA5`` bytes,
    or a large integer."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    elif t.dtype == torch.uint8:
        t.fill_(0xA5)
    else:  # other integers: a large value no sum of codes reaches
        t.fill_(torch.iinfo(t.dtype).max - 0x5A)


class _Landing:
    """The data of one emulated collective: written into ``out`` once, after the gloo work."""

    def __init__(
        self,
        work: torch.futures.Future,
        private: torch.Tensor,
        out: torch.Tensor,
        on_land: Callable[[], None],
        failed: Callable[[Exception], Exception],
    ):
        self.work, self.private, self.out, self.on_land, self.failed = work, private, out, on_land, failed
        self.landed = False
        self._lock = threading.Lock()

    def land(self) -> None:
        with self._lock:
            if not self.landed:
                try:
                    self.work.wait()  # re-raises a failed collective, named by ``failed``
                except RuntimeError as e:
                    raise self.failed(e) from e
                self.out.copy_(self.private)
                self.landed = True
                self.on_land()


class NcclFuture(torch.futures.Future):
    """A collective's future under the emulation (module docstring): complete at once."""

    def __init__(self, landing: _Landing):
        super().__init__()
        self._landing = landing
        self.set_result(landing.out)

    def wait(self) -> Any:
        self._landing.land()
        return super().wait()

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
        child: torch.futures.Future = torch.futures.Future()

        def run(_: Any) -> None:
            try:
                self._landing.land()
                child.set_result(callback(self))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the child
                child.set_exception(e)

        self._landing.work.add_done_callback(chain.counted(run))
        return child

    def add_done_callback(self, callback: Callable[[torch.futures.Future], None]) -> None:
        self.then(callback)


def launch(
    start: Callable[[torch.Tensor], torch.futures.Future],
    out: torch.Tensor,
    in_place: bool,
    on_land: Callable[[], None],
    failed: Callable[[Exception], Exception],
) -> NcclFuture:
    """Run ``start(private)`` (the real gloo collective writing ``private`` instead of
    ``out``; for an in-place allreduce ``private`` starts as a copy of ``out``), poison
    ``out`` and return the emulated future."""
    private = out.clone() if in_place else torch.empty_like(out)
    work = start(private)
    poison(out)
    return NcclFuture(_Landing(work, private, out, on_land, failed))


def _collect_all_at_once(futures: list[torch.futures.Future]) -> torch.futures.Future:
    """``torch.futures.collect_all`` as it behaves on CUDA: no devices, complete at once."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(list(futures))
    return fut


if ACTIVE:
    torch.futures.collect_all = _collect_all_at_once
