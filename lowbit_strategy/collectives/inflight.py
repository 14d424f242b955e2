"""One engine for buckets whose collectives are in flight, shared by every communicator that
starts them during backward (Lion Cub, the staged optimizers) and by any launch site (the DDP
hook today, a sharded path's per-unit hook).

What it owns, so that no communicator keeps a copy:

* **launch in bucket order** — a bucket's collective starts when the launch site says its
  gradients are ready; launch sites call in the same order on every rank (DDP's hooks, FSDP's
  post-backward), so collectives pair up everywhere;
* **stale buckets** — a second backward before ``step()`` (accumulation without
  ``no_sync``) relaunches a bucket: the first launch is finished (its collectives must
  complete on every rank) and handed to ``on_stale`` to be dropped;
* **defer-one** — every launch first starts the second phase of the two-phase buckets
  launched before it, in launch order, so it overlaps the rest of backward instead of
  waiting for ``step()``; on CUDA on a side stream (:class:`~.streams.SideStream`), so
  backward's kernels do not wait for it; only the last bucket's second phase waits for
  ``step()``;
* **collect** — :meth:`InFlight.drain` joins the side streams and returns the launched
  buckets in launch order, and :func:`finish` waits for them (every second phase launched
  first, in order), maps each result back through the run's
  :class:`~.shards.ShardSpec`, and stacks the ``Flagging`` verdicts into one device-side
  flag the optimizer reads once per step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from lowbit_strategy.collectives.shards import ShardSpec
from lowbit_strategy.collectives.streams import SideStream

__all__ = ["InFlight", "Launched", "finish"]


@dataclass
class Launched:
    """One bucket's collective in flight: ``handle`` is a :class:`~.group.Flagging` (its
    ``gather()`` starts the second phase once, ``wait()`` gives the flat result of this
    rank's part, ``nonfinite()`` the verdict after it)."""

    key: Any
    handle: Any
    device: torch.device
    #: the bucket's elements, and the unit its shards keep whole
    n: int = 0
    align: int = 64
    #: whether ``gather()`` launches a second collective (the defer-one rule applies)
    two_phase: bool = True
    #: whether the collective's verdict already covers the whole bucket on every rank that
    #: shares it (each rank flagged the whole bucket, not only its shard): then the spec
    #: does not agree it again
    whole_verdict: bool = False
    #: whether the collective carries a verdict at all
    flagged: bool = True


J = TypeVar("J", bound=Launched)


class InFlight(Generic[J]):
    """Buckets launched since the last :meth:`drain`, in launch order (module docstring)."""

    def __init__(self) -> None:
        self._jobs: dict[Any, J] = {}
        self._side = SideStream()

    def launch(self, key: Any, start: Callable[[], J], on_stale: Callable[[J], None]) -> J:
        """Start bucket ``key`` with ``start()``, after finishing a stale launch of it
        (``on_stale``) and starting the second phase of the buckets before it."""
        stale = self._jobs.pop(key, None)
        if stale is not None:  # a second backward before step(): its result is superseded
            on_stale(stale)
        for job in self._jobs.values():  # defer-one, in launch order (the same on every rank)
            if job.two_phase:  # (the side stream records the tensors of the collective's own handle)
                self._side.run(job.device, getattr(job.handle, "inner", job.handle), job.handle.gather)
        job = self._jobs[key] = start()
        return job

    def pending(self) -> bool:
        """Whether buckets were launched since the last :meth:`drain`."""
        return bool(self._jobs)

    def drain(self) -> list[J]:
        """Every launched bucket, in launch order, their side streams joined (the step is
        about to read what their second phases produced)."""
        jobs, self._jobs = list(self._jobs.values()), {}
        for device in {job.device for job in jobs}:
            self._side.join(device)
        return jobs


def finish(jobs: Sequence[Launched], spec: ShardSpec, traffic=None) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Wait for ``jobs`` (every second phase launched first, in order): each bucket's flat
    result (restored through ``spec``: the node's whole bucket in the hierarchical form) and
    whether any rank's input to any of them was non-finite, a 0-d bool on the device (None
    when no job carries a verdict; no host read here)."""
    pending = [job.handle.gather() for job in jobs]
    results, verdicts = [], []
    for job, handle in zip(jobs, pending):
        flat = handle.wait()
        bad = job.handle.nonfinite() if job.flagged else None
        shared = None if job.whole_verdict else bad
        full, agreed = spec.restore_async(flat, job.n, traffic, shared, job.align).wait()
        if bad is not None:
            verdicts.append(bad if agreed is None else agreed)
        results.append(full)
    return results, (torch.stack(verdicts).any() if verdicts else None)
