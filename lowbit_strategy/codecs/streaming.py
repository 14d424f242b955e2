"""Elementwise chains run slice by slice on the CPU: one pass over memory instead of one per op.

A codec written as ``k`` elementwise torch operations over ``n`` values reads and writes
memory ``k`` times, and on the CPU every fresh full-size temporary also costs a page fault
per 4 KiB on first touch (often more than the arithmetic: torch's CPU allocator does not
cache). Running the same chain on slices of :data:`SLICE` elements through a few small
buffers that are reused (they stay in the core's L2 cache and are never faulted in again)
does the same operations on the same values, so it gives the same bits, with one pass over
memory for the input and one for the output.

What may be sliced and what may not:

* **Elementwise operations** (``mul``, ``round``, ``clamp``, comparisons, casts, integer
  arithmetic) give the same result for an element whatever else is in the tensor: sliced
  freely. Slices start at multiples of :data:`SLICE` (a multiple of every vector width),
  so an op's vectorized and scalar paths meet at the same elements as on the whole tensor.
* **Reductions** are not sliced: their rounding depends on their order, which is torch's
  own (a cascade of partial sums that also differs with the thread count). A codec still
  calls each reduction once on the whole tensor, or, for a reduction along rows
  (``mean(dim=1)``), on whole rows: torch reduces a row in the same order whichever other
  rows share the call, as long as the call has two rows or more (one output alone is
  split across threads inside the row). :func:`row_slices` keeps to that.

On CUDA nothing here is used: a kernel launch per slice would cost more than the memory
traffic it saves; codecs keep their whole-tensor form there.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

#: elements per slice: 256 Ki float32 values (1 MiB) per buffer, in a core's L2 (1-2 MiB)
#: or the shared L3 cache; large enough that the per-op overhead (~5-10 us on a loaded
#: 2-core machine) stays small next to the op's own time. Measured on 4 Mi elements, one
#: thread (CPU time, ms; 2-bit channel encoder / Lion signs packed): 32 Ki 28.9 / 6.1,
#: 128 Ki 13.7 / 4.0, 256 Ki 12.9 / 3.5, 512 Ki 12.4 / 3.4, 1 Mi 19.7 / 3.4
SLICE = 1 << 18


def sliced(t: torch.Tensor) -> bool:
    """Whether a chain over ``t`` should run slice by slice: a CPU tensor of more than one slice."""
    return t.device.type == "cpu" and t.numel() > SLICE


def slices(n: int, size: int = SLICE) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive slices of ``size`` covering ``range(n)``."""
    for start in range(0, n, size):
        yield start, min(start + size, n)


def row_slices(rows: int, cols: int, size: int = SLICE) -> Iterator[tuple[int, int]]:
    """``(first, last)`` rows of slices of about ``size`` elements made of whole rows, at least
    two rows each (see the module docstring: a one-row reduction is ordered differently),
    covering ``range(rows)``; a last slice of one row joins the one before it."""
    step = max(2, size // max(cols, 1))
    starts = list(range(0, rows, step))
    if len(starts) > 1 and rows - starts[-1] < 2:
        starts.pop()
    for i, start in enumerate(starts):
        yield start, starts[i + 1] if i + 1 < len(starts) else rows
