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

A record's ``scope`` says which link it used: ``"network"`` (the default: between nodes, or
any link of a flat run) or ``"node"`` (inside one node, the hierarchical form's reduction
and all-gather: :mod:`.hierarchy`). :attr:`TrafficLog.bytes_sent` counts the network only;
:attr:`TrafficLog.node_bytes_sent` the rest.

Records go to an explicit :class:`TrafficLog` passed as ``traffic=`` and to every log opened
with :func:`recording` in the current context (a ``contextvars`` stack, so concurrent
threads or tasks do not see each other's traffic; DDP hook threads should pass ``traffic=``).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class TrafficRecord:
    """One collective call on this rank. ``seconds``: launch to completion on CPU; None
    where the host cannot see it (CUDA: a collective returns, and its future completes,
    when it is *queued*, so host clocks would read about 0)."""

    op: str
    bytes_sent: int
    bytes_received: int
    world_size: int
    seconds: float | None = 0.0
    scope: str = "network"


#: how many of the latest records a :class:`TrafficLog` keeps for inspection
RECENT = 1024


class TrafficLog:
    """Running totals of the traffic recorded on this rank: O(1) memory and O(1) reads
    however long the run (a record per collective kept forever would be ~200M objects over
    a long run). :attr:`records` holds the latest :data:`RECENT` records, for inspection.
    Compared by identity; safe to add to from the collectives' callback threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.clear()

    def add(self, rec: TrafficRecord) -> None:
        with self._lock:
            if rec.scope == "node":
                self.node_bytes_sent += rec.bytes_sent
                self.node_bytes_received += rec.bytes_received
            else:
                self.bytes_sent += rec.bytes_sent
                self.bytes_received += rec.bytes_received
            self.calls += 1
            if rec.seconds is None:
                self.untimed_calls += 1
            else:
                self._seconds += rec.seconds
            self._by_op[rec.op] = self._by_op.get(rec.op, 0) + rec.bytes_sent
            self.records.append(rec)

    @property
    def seconds(self) -> float | None:
        """Summed launch-to-completion seconds, or None when some call could not be timed
        (CUDA: "unavailable", never a wrong 0)."""
        return None if self.untimed_calls else self._seconds

    def by_op(self) -> dict[str, int]:
        """Bytes sent, summed per op name (a copy)."""
        with self._lock:
            return dict(self._by_op)

    def clear(self) -> None:
        #: bytes this rank sent / received over the network, and collective calls, since the
        #: last clear()
        self.bytes_sent = 0
        self.bytes_received = 0
        #: bytes sent / received inside this rank's node (hierarchical form only)
        self.node_bytes_sent = 0
        self.node_bytes_received = 0
        self.calls = 0
        #: calls whose seconds were not measurable (CUDA)
        self.untimed_calls = 0
        self._seconds = 0.0
        self._by_op: dict[str, int] = {}
        self.records: collections.deque[TrafficRecord] = collections.deque(maxlen=RECENT)


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
        traffic.add(rec)
    for t in targets:
        t.add(rec)


def all_to_all_bytes(chunk_bytes: int, world_size: int) -> int:
    """Bytes one rank sends (= receives) in an all-to-all of ``chunk_bytes`` per peer."""
    return (world_size - 1) * chunk_bytes


def all_gather_bytes(chunk_bytes: int, world_size: int) -> int:
    """Bytes one rank sends (= receives) in a ring all-gather of ``chunk_bytes`` each."""
    return (world_size - 1) * chunk_bytes


def broadcast_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends (= receives) in a pipelined ring broadcast of ``nbytes``: the
    buffer once (the root only sends, the last rank only receives: an upper bound there)."""
    return nbytes if world_size > 1 else 0


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
