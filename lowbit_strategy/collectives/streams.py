"""Where a bucket's second phase runs on CUDA: a side stream, off the compute stream.

The defer-one rule starts the second phase of a two-phase collective (the majority vote's
all-gather, the compensated allreduce's and the two-stage TurboQuant mean's server step and
all-gather) from the *next* bucket's hook, during backward. That phase begins with the
first phase's ``wait()``, which on CUDA makes the current stream wait for the network: on
the compute stream, every later backward kernel would wait for it too. :class:`SideStream`
runs it on a stream of its own instead, and the optimizer's step joins that stream before
it reads the results. On CPU (no streams) both are plain calls.

Memory, by construction (the caching allocator hands a freed block to the next allocation
on the stream that allocated it):

* before the phase runs, the side stream waits for the compute stream, so it sees the
  bucket's inputs, and every block it allocates is reused only after what the compute
  stream had queued;
* the handle's tensors made on the compute stream (phase one's buffers, which the phase
  reads and then drops) are marked with ``record_stream(side)``, so the compute stream
  cannot reuse them while the side stream still reads them;
* :meth:`SideStream.join` makes the compute stream wait for the side stream before the
  step reads what the phase produced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors an in-flight handle holds (its attributes, and tuples/lists of them)."""
    for value in vars(obj).values():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for item in items:
            if isinstance(item, torch.Tensor):
                yield item


class SideStream:
    """One CUDA side stream per device for deferred second phases (module docstring)."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def run(self, device: torch.device, handle: Any, phase: Callable[[], Any]) -> Any:
        """``phase()`` (e.g. ``handle.gather``) on ``device``'s side stream; on CPU, at once."""
        if device.type != "cuda":
            return phase()
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        for t in _tensors(handle):
            if t.is_cuda:
                t.record_stream(side)
        with torch.cuda.stream(side):
            return phase()

    def join(self, device: torch.device) -> None:
        """The compute stream waits for everything queued on ``device``'s side stream."""
        side = self._streams.get(device)
        if side is not None:
            torch.cuda.current_stream(device).wait_stream(side)
