"""Thin, version-tolerant wrappers over the torch.distributed primitives we use.

They read the world size from the process group (never from the environment), skip the
network entirely when the group has one rank, record traffic (:mod:`.wire`), and hide
the torch 2.13 renames (``all_gather_single`` replaces the deprecated
``all_gather_into_tensor``; the fallback keeps torch >= 2.4 working).
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from lowbit_strategy.collectives import chain, emulation, wire


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (the default group when None)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group "
            "(or let Lightning/Accelerate do it) before using a collective"
        )
    return dist.get_world_size(group)


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank inside ``group``."""
    world_size(group)
    return dist.get_rank(group)


def host_seconds(seconds: float, t: torch.Tensor) -> float | None:
    """``seconds`` measured on the host for a collective on ``t``, or None on CUDA: there a
    collective returns (and its future completes) once it is queued, so host clocks see
    about 0 of the transfer (:class:`~.wire.TrafficRecord` reads None as "unavailable")."""
    return None if t.is_cuda else seconds


class CollectiveError(RuntimeError):
    """A collective failed while this rank waited for it: names the operation, and says what
    usually causes it and where the timeout is set."""

    def __init__(self, op: str, kind: str, world: int, cause: BaseException):
        self.op = op
        super().__init__(
            f"lowbit: the collective {op!r} ({kind} over {world} ranks) failed while this rank waited for it: "
            f"{type(cause).__name__}: {cause}. A peer rank has probably died (its own error is in its log); a "
            "peer that hangs ends this after the process group's timeout, set by "
            "torch.distributed.init_process_group(timeout=...), Lightning's DDPStrategy(timeout=...) / "
            "LowBitStrategy(timeout=...), or Accelerate's InitProcessGroupKwargs(timeout=...)"
        )


def _blocking(op: str, kind: str, world: int, call) -> float:
    """Run a blocking collective; its wall seconds, or :class:`CollectiveError` naming ``op``."""
    with wire.timed() as t:
        try:
            call()
        except RuntimeError as e:
            raise CollectiveError(op, kind, world, e) from e
    return t.seconds


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group, op: str, traffic=None) -> None:
    """Equal-split all-to-all of 1-D ``inp`` into ``out`` (chunk i goes to rank i)."""
    p = world_size(group)
    if p == 1:
        out.copy_(inp)
    seconds = _blocking(op, "all-to-all", p, lambda: p > 1 and dist.all_to_all_single(out, inp, group=group))
    chunk = _nbytes(inp) // p
    n = wire.all_to_all_bytes(chunk, p)
    wire.record(wire.TrafficRecord(op, n, n, p, host_seconds(seconds, out), scope(group)), traffic)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group, op: str, traffic=None) -> None:
    """Gather every rank's 1-D ``inp`` into ``out`` (rank order). Reads ``out`` itself:
    on gloo a gather's future resolves to per-rank chunks, not to the output buffer."""
    p = world_size(group)
    if p == 1:
        out.copy_(inp)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    seconds = _blocking(op, "all-gather", p, lambda: p > 1 and gather(out, inp, group=group))
    n = wire.all_gather_bytes(_nbytes(inp), p)
    wire.record(wire.TrafficRecord(op, n, n, p, host_seconds(seconds, out), scope(group)), traffic)


def all_reduce_sum(buf: torch.Tensor, group, op: str, traffic=None) -> None:
    """In-place SUM allreduce of ``buf``."""
    p = world_size(group)
    seconds = _blocking(op, "SUM allreduce", p, lambda: p > 1 and dist.all_reduce(buf, group=group))
    n = wire.allreduce_bytes(_nbytes(buf), p)
    wire.record(wire.TrafficRecord(op, n, n, p, host_seconds(seconds, buf), scope(group)), traffic)


def all_reduce_max(buf: torch.Tensor, group, op: str, traffic=None) -> None:
    """In-place MAX allreduce of ``buf`` (bytes as for a SUM allreduce: a ring of P chunks)."""
    p = world_size(group)
    max_ = dist.ReduceOp.MAX
    seconds = _blocking(op, "MAX allreduce", p, lambda: p > 1 and dist.all_reduce(buf, op=max_, group=group))
    n = wire.allreduce_bytes(_nbytes(buf), p)
    wire.record(wire.TrafficRecord(op, n, n, p, host_seconds(seconds, buf), scope(group)), traffic)


def broadcast(buf: torch.Tensor, src_rank: int, group, op: str, traffic=None) -> None:
    """``buf`` of rank ``src_rank`` of ``group`` on every rank (in place). Bytes: a pipelined
    ring broadcast, every rank forwards (and receives) the buffer once."""
    p = world_size(group)
    src = dist.get_global_rank(group, src_rank) if group is not None and p > 1 else src_rank
    seconds = _blocking(op, "broadcast", p, lambda: p > 1 and dist.broadcast(buf, src=src, group=group))
    n = wire.broadcast_bytes(_nbytes(buf), p)
    wire.record(wire.TrafficRecord(op, n, n, p, host_seconds(seconds, buf), scope(group)), traffic)


class Pending:
    """Launched collectives: :meth:`wait` waits for each one's own future, in launch order,
    then returns ``finish()``, the caller's decode of the raw results. Launch order is the
    caller's business: every rank must launch its collectives in the same order (gloo pairs
    them by order).

    Each future is waited on by itself: on NCCL a collective's future completes when the
    operation is queued, and only its own ``wait()`` orders the reads after its data (a
    ``torch.futures.collect_all`` of several would carry no devices and wait for nothing)."""

    __slots__ = ("futures", "finish")

    def __init__(self, futures: torch.futures.Future | Sequence[torch.futures.Future], finish: Callable[[], Any]):
        self.futures = tuple(futures) if isinstance(futures, (list, tuple)) else (futures,)
        self.finish = finish

    def wait(self) -> Any:
        for f in self.futures:
            f.wait()  # re-raises a failed collective
        return self.finish()


class Waitable(Protocol):
    """A launched collective :meth:`wait` finishes (:class:`Pending`, :class:`TwoPhase`, ...)."""

    def wait(self) -> Any: ...


class Gatherable(Protocol):
    """A collective in flight with the two-phase interface: :meth:`gather` launches the second
    phase (once) and returns what finishes it; :meth:`wait` is ``gather().wait()``.
    :class:`TwoPhase` has it, and so do one-phase handles whose ``gather()`` returns themselves."""

    def gather(self) -> Waitable: ...

    def wait(self) -> Any: ...


class Flagging(Gatherable, Protocol):
    """A :class:`Gatherable` whose result tells whether any rank's input was non-finite."""

    def nonfinite(self) -> torch.Tensor:
        """After the wait: a 0-d bool tensor on the device, True when any rank's input held
        NaN/Inf; the same on every rank (it is computed from data every rank received)."""
        ...


def nonfinite(scales: torch.Tensor | None, what: str) -> torch.Tensor:
    """``~isfinite(scales).all()`` as a 0-d bool tensor on the device (no host read): the
    verdict of a collective whose scales every rank received, where a NaN/Inf input on any
    rank shows as a non-finite scale (:meth:`Flagging.nonfinite`)."""
    if scales is None:
        raise RuntimeError(f"{what}.nonfinite() needs the collective's result: call wait() first")
    return ~torch.isfinite(scales).all()


class TwoPhase:
    """A two-phase collective in flight whose second collective needs the first one's data
    (the majority vote, the compensated 1-bit allreduce, the two-stage TurboQuant mean).

    :meth:`gather` waits for phase one, runs this rank's local step and launches phase two,
    once: later calls return the same :class:`Pending` (so an optimizer may advance a bucket
    from the next bucket's hook and still finish it in ``step()``). Call it on every rank in
    the order the collectives were started, never from a future's callback. Subclasses
    implement :meth:`_second_phase`.
    """

    _pending: Pending | None = None

    def gather(self) -> Pending:
        if self._pending is None:
            self._pending = self._second_phase()
        return self._pending

    def wait(self):
        """``gather().wait()``: the result."""
        return self.gather().wait()

    def _second_phase(self) -> Pending:
        raise NotImplementedError


_NODE_LOCAL: set[int] = set()


def mark_node_local(group) -> None:
    """``group``'s ranks share one node: its collectives' records get scope ``"node"``
    (:mod:`.hierarchy`)."""
    _NODE_LOCAL.add(id(group))


def scope(group) -> str:
    """``"node"`` for a group of :func:`mark_node_local`, else ``"network"``."""
    return "node" if group is not None and id(group) in _NODE_LOCAL else "network"


def _launch(kind: str, out: torch.Tensor, inp: torch.Tensor, group, op: str, traffic) -> torch.futures.Future:
    """Start an async all-gather or all-to-all of ``inp`` into ``out`` (or an in-place SUM
    allreduce of ``out``); the future resolves to ``out``. Gloo's gather future yields
    per-rank chunks, so we always read the buffer we allocated. The traffic record (same
    byte formulas as the blocking wrappers) is written on completion, in the caller's
    context (its active :func:`~.wire.recording` logs), with launch-to-completion seconds."""
    p = world_size(group)
    nbytes = inp.numel() * inp.element_size()
    n = {
        "gather": wire.all_gather_bytes(nbytes, p),
        "allreduce": wire.allreduce_bytes(nbytes, p),
        "all_to_all": wire.all_to_all_bytes(nbytes // p, p),
    }[kind]
    ctx, start = contextvars.copy_context(), time.perf_counter()

    def record() -> None:
        seconds = host_seconds(time.perf_counter() - start, out)
        ctx.run(wire.record, wire.TrafficRecord(op, n, n, p, seconds, scope(group)), traffic)

    def begin(dest: torch.Tensor) -> torch.futures.Future:
        with record_function(f"lowbit.launch:{op}"):  # the launch, labelled in profiles
            if kind == "gather":
                gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                return gather(dest, inp, group=group, async_op=True).get_future()
            if kind == "all_to_all":
                return dist.all_to_all_single(dest, inp, group=group, async_op=True).get_future()
            return dist.all_reduce(dest, op=dist.ReduceOp.SUM, group=group, async_op=True).get_future()

    if p > 1 and emulation.ACTIVE:  # NCCL's completion semantics on CPU (tests)
        return emulation.launch(begin, out, kind == "allreduce", record, lambda e: CollectiveError(op, kind, p, e))
    if p == 1:
        if kind != "allreduce":
            out.copy_(inp)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
    else:
        fut = begin(out)

    def done(f: torch.futures.Future) -> torch.Tensor:
        try:
            f.value()  # re-raise a failed collective, naming it
        except RuntimeError as e:
            raise CollectiveError(op, kind, p, e) from e
        record()
        return out

    return chain.then(fut, done)


def all_gather_async(out: torch.Tensor, inp: torch.Tensor, group, op: str, traffic=None) -> torch.futures.Future:
    """Async :func:`all_gather`: a future resolving to ``out`` (rank order)."""
    return _launch("gather", out, inp, group, op, traffic)


def all_to_all_async(out: torch.Tensor, inp: torch.Tensor, group, op: str, traffic=None) -> torch.futures.Future:
    """Async :func:`all_to_all`: a future resolving to ``out``."""
    return _launch("all_to_all", out, inp, group, op, traffic)


def all_reduce_sum_async(buf: torch.Tensor, group, op: str, traffic=None) -> torch.futures.Future:
    """Async in-place :func:`all_reduce_sum`: a future resolving to ``buf``."""
    return _launch("allreduce", buf, buf, group, op, traffic)


def check_consistent(x: torch.Tensor, group, what: str, problem: str | None = None, traffic=None) -> None:
    """Debug check run with ``check=True``: every rank learns whether any rank passed a
    different length or had invalid input (``problem``), and all of them raise together.

    Without it, a rank whose input is rejected raises alone while its peers wait in the
    collective until the process group's timeout. Costs one small all-gather.
    """
    p = world_size(group)
    mine = torch.tensor([x.numel(), problem is not None], dtype=torch.int64, device=x.device)
    every = torch.empty(2 * p, dtype=torch.int64, device=x.device)
    all_gather(every, mine, group, f"{what}.check", traffic)
    lengths, bad = every.view(p, 2).t().tolist()
    if problem is not None:
        raise ValueError(f"{what}: {problem}")
    if any(bad):
        ranks = [r for r, b in enumerate(bad) if b]
        raise ValueError(f"{what}: invalid input on rank(s) {ranks}; see the error raised there")
    if len(set(lengths)) != 1:
        raise ValueError(
            f"{what}: ranks passed tensors of different lengths {lengths} (index = rank); "
            "every rank must synchronize the same number of elements"
        )


def validated(validate, x, group, what: str, check: bool, traffic=None) -> None:
    """Run ``validate()`` (argument checks that raise ``TypeError``/``ValueError``, or
    ``OverflowError`` for a range no lane holds). Without ``check`` its error propagates on
    this rank alone; with ``check`` every rank learns about a bad rank or a length mismatch
    (:func:`check_consistent`: one small all-gather) and all of them raise together, this
    rank's own error first."""
    try:
        validate()
    except (TypeError, ValueError, OverflowError) as e:
        if not check:
            raise
        problem: Exception | None = e
    else:
        problem = None
    if check:
        try:
            mine = x if isinstance(x, torch.Tensor) else torch.empty(0)
            check_consistent(mine, group, what, None if problem is None else str(problem), traffic)
        except ValueError:
            if problem is not None:
                raise problem from None
            raise


_CPU_GROUPS: dict[Any, Any] = {}


def cpu_group(group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """A process group over ``group``'s ranks that moves CPU tensors (setup agreements,
    checkpoints): ``group`` itself when gloo moves its CPU tensors (backend ``gloo``, or a
    per-device one such as ``cpu:gloo,cuda:nccl``), else a gloo group made on first use (only
    the member ranks take part, ``use_local_synchronization``) and kept. So nothing of this
    kind is ever staged on a GPU."""
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("torch.distributed is not initialized: no process group to agree over")
    target = group if group is not None else world
    backend = str(dist.get_backend(target))
    if backend == "gloo" or "cpu:gloo" in backend.split(","):
        return target
    key = (id(world), id(group))  # a new default group (after re-initialization) gets its own
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = dist.new_group(
            dist.get_process_group_ranks(target), backend="gloo", use_local_synchronization=True
        )
    return _CPU_GROUPS[key]
