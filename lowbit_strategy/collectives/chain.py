"""Python callbacks chained on collective futures, and an orderly exit for them.

Every ``Future.then(fn)`` of the library goes through :func:`then`. The reason is the exit
of a process. gloo completes a collective on one of its worker threads, which runs the
chained Python callbacks and then, *after* the waiting thread has been woken, releases
them, taking the GIL once more to do so. When the main thread finishes the script within
those few milliseconds (the last step's exchange completes, the script prints and returns)
and the interpreter starts to finalize, that worker thread can no longer take the GIL:
CPython ends it with ``pthread_exit``, whose forced unwinding through a ``noexcept`` C++
frame calls ``std::terminate``. The job trained, then aborts with SIGABRT ("terminate
called without an active exception") and its launcher reports a failed run. Measured on a
2-core machine: 4 aborts in 25 runs of the Accelerate quick start under load.

:func:`then` counts each callback until the worker thread has released it; :func:`settle`,
registered with :mod:`atexit` when this module is imported (exit handlers run while the
interpreter is still whole), waits with the GIL released until that count is zero, no foreign
thread runs Python and no thread of the process is runnable, so no worker thread needs the
interpreter once it finalizes. A callback that never runs (its
collective hangs) cannot be waited for: :func:`settle` gives up after ``timeout_s`` and
says so in the log.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_live = 0
_ever = False


class _Counted:
    """``fn``, counted from creation until torch drops its last reference (on whichever
    thread ran it)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[torch.futures.Future], Any]) -> None:
        global _live, _ever
        self.fn = fn
        with _lock:
            _live += 1
            _ever = True

    def __call__(self, fut: torch.futures.Future) -> Any:
        return self.fn(fut)

    def __del__(self) -> None:
        global _live
        with _lock:
            _live -= 1


def counted(fn: Callable[[torch.futures.Future], Any]) -> Callable[[torch.futures.Future], Any]:
    """``fn`` counted until torch releases it: for ``add_done_callback``."""
    return _Counted(fn)


def then(fut: torch.futures.Future, fn: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
    """``fut.then(fn)``, with ``fn`` counted until released, so :func:`settle` can wait for it."""
    return fut.then(_Counted(fn))


def pending() -> int:
    """Callbacks chained by :func:`then` that torch has not released yet."""
    return _live


#: after the count reaches zero and no foreign thread runs Python: how long every other thread of
#: the process must be seen asleep, and the most :func:`settle` waits for that
_QUIET_S, _QUIET_MAX_S = 0.005, 1.0


def _foreign_python() -> list[int]:
    """Threads not started by :mod:`threading` (gloo's workers) that are running Python code
    now: a callback, or a destructor its release triggered (``sys._current_frames`` lists
    every thread state with a frame; ``_DummyThread`` entries are such foreign threads that
    happened to ask for ``threading.current_thread()``)."""
    ours = {t.ident for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}
    return [ident for ident in sys._current_frames() if ident not in ours]


def _runnable_threads() -> list[int]:
    """Native ids of this process's threads, the caller's excepted, that are running or waiting
    for a core (state ``R`` in ``/proc/self/task/*/stat``); empty where ``/proc`` is missing.

    A gloo worker thread whose collective has completed still releases, after the callback
    count has dropped and without a Python frame, what the chained future held: the callback's
    return value (a Python object in the child future) and the collective's tensors, whose
    Python objects it may own. Each needs the GIL once more. Preempted just before, the
    thread is runnable, not asleep: this sees it. A thread asleep is either idle (waiting for
    work) or waiting for the GIL, which it gets at once while :func:`settle` sleeps."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    busy = []
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # the thread has exited
            continue
        end = stat.rfind(b")")  # the name is in parentheses and may hold anything
        if stat[end + 2 : end + 3] == b"R":
            busy.append(int(tid))
    return busy


def _quiet(hold_s: float = _QUIET_S, max_s: float = _QUIET_MAX_S) -> bool:
    """Sleep (the GIL released) until no other thread has been runnable for ``hold_s``, at most
    ``max_s`` (a thread that spins for ever, e.g. under ``OMP_WAIT_POLICY=active``, only costs
    that long); whether it got quiet."""
    deadline = time.monotonic() + max_s
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < hold_s:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
        if _runnable_threads():
            quiet_since = time.monotonic()
    return True


def settle(timeout_s: float = 10.0) -> bool:
    """Wait, with the GIL released, until every callback chained by :func:`then` has been
    released by the thread that ran it and no foreign thread is still running Python code
    (at most ``timeout_s``); whether that happened.

    The count alone is not enough: it drops inside the callback's ``__del__``, on the worker
    thread, and that thread may still run Python afterwards (the rest of the destructor, the
    destructors of what the callback held) and, preempted there, needs the GIL once more. A
    thread preempted inside Python keeps its frame, so :func:`_foreign_python` sees it until it
    is done. After its last frame it may still need the GIL, without a frame, to release what
    the chained future held; :func:`_quiet` then waits until no thread of the process is
    runnable (measured: 20 ms of sleep alone still let a preempted 4-rank job abort at exit).

    Registered at exit; also safe to call at any time (e.g. before a fork)."""
    deadline = time.monotonic() + timeout_s
    while _live > 0 or (_ever and _foreign_python()):
        if time.monotonic() > deadline:
            logger.warning(
                "lowbit: %d collective callbacks still held by torch's worker threads (%d running Python) "
                "after %.0f s at exit (a collective that never completed?); the process may abort while "
                "the interpreter finalizes",
                _live,
                len(_foreign_python()),
                timeout_s,
            )
            return False
        time.sleep(0.001)
    if _ever or _distributed():
        _quiet()
    return True


def _distributed() -> bool:
    """A process group exists (gloo's workers release collectives' tensors too, callbacks or not)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


atexit.register(settle)
