"""Run one command per rank with a deadline, and never leave a rank process behind.

Used by :mod:`benchmarks.harness.netem`; independent of namespaces. Each process gets its own
session (so a terminal's Ctrl-C reaches only the harness, which then kills the ranks in
order) and a parent-death signal (so even a harness killed with SIGKILL takes its ranks
with it). Output (stdout and stderr merged) is collected per rank and optionally echoed
live with a ``[rI]`` prefix.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Sequence


@dataclass
class Finished:
    """Exit codes (None: killed before it exited on its own), outputs, wall time."""

    returncodes: list[int | None]
    outputs: list[str]
    seconds: float
    timed_out: bool


def launch(argvs: Sequence[Sequence[str]], envs: Sequence[dict[str, str]], *, timeout: float,
           echo: Sequence[int] = (), cwd: str | None = None, grace_s: float = 10.0) -> Finished:
    """Start ``argvs[i]`` with environment ``envs[i]`` for every i and wait for all of them.

    Past ``timeout`` seconds, or ``grace_s`` after the first one exits non-zero (its peers
    would otherwise wait in a collective until their own timeout), the rest are killed:
    SIGTERM to the process group, SIGKILL 3 s later. Exceptions (Ctrl-C included) kill
    them too before propagating.
    """
    procs: list[subprocess.Popen] = []
    sinks: list[list[str]] = [[] for _ in argvs]
    readers: list[threading.Thread] = []
    start = time.monotonic()
    timed_out = False
    exited: list[int | None] = []
    try:
        for rank, (argv, env) in enumerate(zip(argvs, envs)):
            proc = subprocess.Popen(list(argv), env=env, cwd=cwd, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace",
                                    start_new_session=True, preexec_fn=_die_with_parent)
            procs.append(proc)
            reader = threading.Thread(target=_pump, args=(proc, sinks[rank], rank, rank in echo), daemon=True)
            reader.start()
            readers.append(reader)
        failed_at = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
                failed_at = now
            if now - start > timeout:
                timed_out = True
                break
            if failed_at is not None and now - failed_at > grace_s:
                break
            time.sleep(0.05)
        exited = [p.poll() for p in procs]
    finally:
        kill(procs)
        for reader in readers:
            reader.join(timeout=5)
    return Finished(exited, ["".join(s) for s in sinks], time.monotonic() - start, timed_out)


def _pump(proc: subprocess.Popen, sink: list[str], rank: int, echo: bool) -> None:
    for line in proc.stdout:
        sink.append(line)
        if echo:
            print(f"[r{rank}] {line}", end="", flush=True)


def _die_with_parent() -> None:
    """In the child before exec: receive SIGKILL when the harness dies, however it dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def kill(procs: Sequence[subprocess.Popen]) -> None:
    """SIGTERM each live process group, then SIGKILL whatever is left after 3 s."""
    for sig, wait_s in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        for p in live:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
