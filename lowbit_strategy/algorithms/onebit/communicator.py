"""OneBitCommunicator: the compressed momentum allreduce of 1-bit Adam / 1-bit LAMB, per bucket.

The optimizer hands it, per bucket of parameters, this rank's locally updated momenta; it
returns their error-compensated 1-bit mean over ranks
(:func:`lowbit_strategy.collectives.compensated.compensated_allreduce_start`: all-to-all
of sign chunks, server average, all-gather; "1-bit LAMB", Li et al., arXiv:2104.06069,
Algorithm 1 lines 7-13). Two ways in, with the same result bit for bit:

* :meth:`launch` from the DDP communication hook, one bucket at a time as backward makes
  its gradients ready (the first phase overlaps the rest of backward), then :meth:`collect`
  in ``step()``;
* :meth:`synchronize` in ``step()`` for the buckets not launched during backward.

Buckets are the optimizer's own fixed layout (not DDP's buckets, which DDP rebuilds after
its first iteration): the compressed result depends on which elements share a scale, so a
fixed layout keeps overlap on and off, and a resumed run, bit for bit the same. ``block``
(elements per scale, a multiple of 8; None: one scale per bucket) cuts every bucket into
blocks with their own scales, so the scale granularity does not depend on the bucket
size (the collective's "Block scales"). Error
buffers are rank-local state, one (worker, server) pair per bucket, keyed by the bucket's
parameter indices in the optimizer. A step's new errors are only *committed*
(:meth:`commit`) once the optimizer has decided to apply the step: a skipped step (NaN/Inf
on any rank) leaves them as they were (:meth:`discard`). Non-finite input needs no extra
collective: it makes every rank's server scales non-finite, and every rank sees all of them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from lowbit_strategy import buckets
from lowbit_strategy.collectives import group as g
from lowbit_strategy.codecs.scaled_signs import check_block
from lowbit_strategy.collectives import wire
from lowbit_strategy.collectives.compensated import compensated_allreduce_start, compensated_error_buffers

logger = logging.getLogger(__name__)

Key = tuple[int, ...]


@dataclass
class _Job:
    key: Key
    like: list               # the momenta sent (shapes and dtypes of the results)
    flat: torch.Tensor       # float32; the result is written here
    errors: tuple            # this step's (worker, server) error buffers, committed on success
    handle: object


class OneBitCommunicator:
    """Process group + error buffers: synchronizes momenta with the compensated 1-bit allreduce."""

    def __init__(self, group=None, bucket_size_mb: float = 25.0, debug: bool = False, block: int | None = None):
        check_block(block, "OneBitCommunicator")
        self.group = group
        #: elements per scale block of the compressed allreduce (None: one scale per bucket)
        self.block = block
        self.world_size = g.world_size(group)
        #: elements per bucket of the optimizer's fixed layout
        self.bucket_numel = buckets.bucket_numel(bucket_size_mb)
        self.debug = debug
        self.traffic = wire.TrafficLog()
        self.errors: dict[Key, tuple[torch.Tensor, torch.Tensor]] = {}
        self._inflight: dict[Key, _Job] = {}
        self._finished: list[_Job] = []

    # ---- one bucket ----------------------------------------------------------------
    def _start(self, key: Key, momenta: Sequence[torch.Tensor]) -> _Job:
        flat = buckets.flatten([m.float() for m in momenta])
        saved = self.errors.get(key)
        if saved is None or saved[0].numel() != flat.numel() or saved[0].device != flat.device:
            if self.errors and saved is None:
                logger.info("lowbit: 1-bit allreduce bucket %s is new (bucket layout changed); its errors start at 0",
                            key[:4] + ((...,) if len(key) > 4 else ()))
            worker, server = compensated_error_buffers(flat, self.group)
        else:
            # work on copies: the step may still be skipped, and then the errors must not move
            worker, server = saved[0].clone(), saved[1].clone()
        handle = compensated_allreduce_start(flat, worker, server, self.group, out=flat, check=self.debug,
                                             traffic=self.traffic, block=self.block)
        return _Job(key, list(momenta), flat, (worker, server), handle)

    def _finish(self, jobs: Sequence[_Job]) -> tuple[list[list[torch.Tensor]], bool]:
        pending = [job.handle.gather() for job in jobs]  # second phases launched first, in order
        results, bad = [], False
        for job, handle in zip(jobs, pending):
            handle.wait()
            bad = bad or not bool(torch.isfinite(job.handle.server_scales).all())
            results.append(buckets.unflatten(job.flat, job.like))
        self._finished.extend(jobs)
        return results, bad

    # ---- overlapped with backward --------------------------------------------------
    def launch(self, key: Key, momenta: Sequence[torch.Tensor]) -> None:
        """Start one DDP bucket's allreduce (from the communication hook)."""
        stale = self._inflight.pop(key, None)
        if stale is not None:  # a second backward before step(): its result is superseded
            self._finish([stale])
            self._finished.remove(stale)
        # Defer-one rule: start the second phase of the buckets launched before this one, in
        # launch order (the same on every rank), so it overlaps the rest of backward.
        for job in self._inflight.values():
            job.handle.gather()
        self._inflight[key] = self._start(key, momenta)

    def pending(self) -> bool:
        return bool(self._inflight)

    def collect(self) -> tuple[dict[Key, list[torch.Tensor]], bool]:
        """Finish every launched bucket: ``({key: mean momenta}, any rank non-finite)``."""
        jobs, self._inflight = list(self._inflight.values()), {}
        results, bad = self._finish(jobs)
        return {job.key: r for job, r in zip(jobs, results)}, bad

    # ---- at step time ----------------------------------------------------------------
    def synchronize(self, jobs: Sequence[tuple[Key, Sequence[torch.Tensor]]]) -> tuple[list[list[torch.Tensor]], bool]:
        """Mean momenta of each ``(key, momenta)`` bucket, in the order given:
        ``(results per bucket, any rank non-finite)``."""
        return self._finish([self._start(key, momenta) for key, momenta in jobs])

    def commit(self) -> None:
        """The step was applied: this step's error buffers become the state."""
        for job in self._finished:
            self.errors[job.key] = job.errors
        self._finished = []

    def discard(self) -> None:
        """The step was skipped: keep the previous errors."""
        self._finished = []

    # ---- rank-local state --------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"world_size": self.world_size,
                "errors": {",".join(map(str, k)): (w.detach().cpu().clone(), s.detach().cpu().clone())
                           for k, (w, s) in self.errors.items()}}

    def load_state_dict(self, state: dict, device) -> None:
        if state.get("world_size", self.world_size) != self.world_size:
            logger.warning("lowbit: 1-bit error buffers were saved at world size %s, running %d: they start at 0",
                           state.get("world_size"), self.world_size)
            self.errors = {}
            return
        self.errors = {tuple(int(i) for i in k.split(",")): (w.to(device), s.to(device))
                       for k, (w, s) in state.get("errors", {}).items()}
