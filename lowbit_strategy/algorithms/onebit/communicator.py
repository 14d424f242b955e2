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

from dataclasses import dataclass
from typing import ClassVar, cast

import torch

from lowbit_strategy.algorithms.staged import BucketCommunicator, Key
from lowbit_strategy.algorithms.staged.state import BucketState
from lowbit_strategy.codecs.scaled_signs import check_scale_block
from lowbit_strategy.collectives.compensated import (
    compensated_allreduce_start,
    compensated_error_buffers,
)
from lowbit_strategy.collectives.hierarchy import Topology
from lowbit_strategy.collectives.shards import ShardSpec

__all__ = ["Key", "OneBitCommunicator", "OneBitState"]


@dataclass
class OneBitState(BucketState):
    """A bucket's error buffers: ``worker`` (this rank's part of the bucket: e ← v − C[v]) and
    ``server`` (the chunk this rank averages as the server: its re-compression error)."""

    server: torch.Tensor

    legacy_fields: ClassVar[tuple[str, ...]] = ("worker", "server")


class OneBitCommunicator(BucketCommunicator):
    """Process group + error buffers: synchronizes momenta with the compensated 1-bit allreduce.

    Per-bucket state (``errors[key]``): its :class:`OneBitState`."""

    label = "1-bit allreduce"
    state_class = OneBitState

    def __init__(
        self,
        group=None,
        bucket_size_mb: float = 25.0,
        debug: bool = False,
        block: int | None = None,
        topology: Topology | None = None,
        spec: ShardSpec | None = None,
    ):
        check_scale_block(block, "OneBitCommunicator")
        super().__init__(group, bucket_size_mb, debug, topology, spec)
        #: elements per scale block of the compressed allreduce (None: one scale per bucket)
        self.block = block
        #: per bucket: a free server error buffer (the one the committed state replaced)
        self._server_spare: dict[Key, torch.Tensor] = {}
        self.shard_align = block or self.shard_align

    def _start_bucket(self, key: Key, flat: torch.Tensor, saved):
        if saved is None:
            worker, server = compensated_error_buffers(flat, self.group)
        else:
            own = cast(OneBitState, saved)  # (state_class)
            worker, server = own.worker, own.server
        # v = x + e is symmetric: the committed worker error goes in as the vector and the
        # buffer holding this step's momenta as the error buffer, which becomes the new error
        # (the same floats: fl(x + e) = fl(e + x)); the server's new error is a new buffer too.
        # Nothing committed is written, so a skipped step keeps it without a copy.
        handle = compensated_allreduce_start(
            worker,
            flat,
            server,
            self.group,
            out=self._result_buffer(key, flat),
            check=self.debug,
            traffic=self.traffic,
            block=self.block,
            keep_server_error=True,
            server_out=self._take(self._server_spare, key, server.numel(), server.device),
        )
        return OneBitState(flat, server), handle

    def _released(self, key, state):
        self._spare[key], self._server_spare[key] = state.worker, state.server

    def _settled(self, state, handle):
        return OneBitState(state.worker, handle.server_error)
