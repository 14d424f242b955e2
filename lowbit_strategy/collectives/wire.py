"""Bytes on the wire: what each collective call sent and received, counted per rank.

Every collective in this package records one :class:`TrafficRecord` per underlying
torch.distributed call, with the bytes *this rank* sends and receives under the
bandwidth-optimal algorithm for that primitive (the α–β model of Thakur et al. 2005 that
Lion Cub's Table 1 uses):

* all-to-all, ``c`` bytes to each peer:        sent = received = (P-1)·c
* all-gather, ``c`` bytes contributed by each: sent = received = (P-1)·c   (ring)
* allreduce of ``n`` bytes:                    sent = received = 2·(P-1)·ceil(n/P)
  (ring reduce-scatter + all-gather over P chunks of ceil(n/P) bytes)

These are the payload bytes the algorithm must move; the emulated-network benchmarks
read the interfaces' counters to compare them with what really crossed the link.

Records go to an explicit :class:`TrafficLog` passed as ``traffic=`` and to every log opened
with :func:`recording` in the current context (a ``contextvars`` stack, so concurrent
threads or tasks do not see each other's traffic; DDP hook threads should pass ``traffic=``).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TrafficRecord:
    """One collective call on this rank."""

    op: str
    bytes_sent: int
    bytes_received: int
    world_size: int
    seconds: float = 0.0


@dataclass(eq=False)
class TrafficLog:
    """An append-only list of :class:`TrafficRecord` with totals (compared by identity)."""

    records: list[TrafficRecord] = field(default_factory=list)

    @property
    def bytes_sent(self) -> int:
        return sum(r.bytes_sent for r in self.records)

    @property
    def bytes_received(self) -> int:
        return sum(r.bytes_received for r in self.records)

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.records)

    def by_op(self) -> dict[str, int]:
        """Bytes sent, summed per op name."""
        out: dict[str, int] = {}
        for r in self.records:
            out[r.op] = out.get(r.op, 0) + r.bytes_sent
        return out

    def clear(self) -> None:
        self.records.clear()


_ACTIVE: contextvars.ContextVar[tuple[TrafficLog, ...]] = contextvars.ContextVar("lowbit_traffic_logs", default=())


@contextlib.contextmanager
def recording(traffic: TrafficLog | None = None) -> Iterator[TrafficLog]:
    """Collect the traffic of every collective called inside the ``with`` block."""
    traffic = TrafficLog() if traffic is None else traffic
    token = _ACTIVE.set(_ACTIVE.get() + (traffic,))
    try:
        yield traffic
    finally:
        _ACTIVE.reset(token)


def record(rec: TrafficRecord, traffic: TrafficLog | None = None) -> None:
    """Append ``rec`` to ``traffic`` (if given) and to every active :func:`recording`."""
    targets = _ACTIVE.get()
    if traffic is not None and all(traffic is not t for t in targets):
        traffic.records.append(rec)
    for t in targets:
        t.records.append(rec)


def all_to_all_bytes(chunk_bytes: int, world_size: int) -> int:
    """Bytes one rank sends (= receives) in an all-to-all of ``chunk_bytes`` per peer."""
    return (world_size - 1) * chunk_bytes


def all_gather_bytes(chunk_bytes: int, world_size: int) -> int:
    """Bytes one rank sends (= receives) in a ring all-gather of ``chunk_bytes`` each."""
    return (world_size - 1) * chunk_bytes


def allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends (= receives) in a ring allreduce of an ``nbytes`` buffer."""
    if world_size <= 1:
        return 0
    return 2 * (world_size - 1) * (-(-nbytes // world_size))


class timed:
    """Context manager measuring wall seconds of a blocking collective call."""

    __slots__ = ("start", "seconds")

    def __enter__(self) -> timed:
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
