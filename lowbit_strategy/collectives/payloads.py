"""Every worker's payload, gathered: the collective of DeMo's exchange (and of any codec whose
receivers decode each sender's bytes rather than a sum).

A payload is one uint8 buffer per worker, the same length on every worker. Under the run's
:class:`~.shards.ShardSpec`:

* :class:`~.shards.Whole` and :class:`~.shards.LocalShard` — one all-gather over the workers;
* :class:`~.shards.NodeShard` (the hierarchical DDP form: every rank of a node holds the node's
  payload) — local rank j all-gathers bytes ``shard(B)`` of it across nodes, then the node
  all-gathers those results (the spec's own way back). The cross-node result of rank j is laid
  out byte-major (byte b of every node, then byte b + 1) so that the node's gather of the
  ``B·N``-byte result, in units of N, is exactly the shards in local-rank order; it is turned
  back to ``(N, B)`` at the end. Each node's payload crosses the network once, split over its
  ranks, as the gradient shards of the hierarchical form do.

:class:`PayloadGather` is a :class:`~.group.TwoPhase`: the cross-node all-gather starts at
construction; :meth:`~.group.TwoPhase.gather` (called on every rank in launch order, never from
a callback) waits for it and starts the node's gather; ``wait()`` returns ``(N, B)`` uint8, worker
(node) order.
"""

from __future__ import annotations

import torch

from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.shards import ShardSpec, pad_empty

__all__ = ["PayloadGather"]


class PayloadGather(g.TwoPhase):
    """All workers' ``payload`` (module docstring); ``op`` names it in traffic records."""

    def __init__(self, payload: torch.Tensor, spec: ShardSpec, op: str, traffic=None):
        self.spec, self.op, self.traffic = spec, op, traffic
        self.nbytes = payload.numel()
        self.workers = spec.world_size
        lo, hi = spec.part(self.nbytes, 1)
        self._length = hi - lo
        mine = pad_empty(payload[lo:hi].contiguous())
        self._out = torch.empty(self.workers * mine.numel(), dtype=torch.uint8, device=payload.device)
        self._first = g.all_gather_async(self._out, mine, spec.group, op, traffic)

    def _second_phase(self) -> g.Pending:
        self._first.wait()
        n, b = self.workers, self.nbytes
        rows = self._out.view(n, -1)[:, : self._length]
        byte_major = rows.t().contiguous().reshape(-1)  # byte i of every worker, then byte i + 1
        back = self.spec.restore_async(byte_major, b * n, self.traffic, None, n)

        def finish() -> torch.Tensor:
            full, _ = back.value()
            return full.reshape(b, n).t().contiguous()

        return g.Pending(back, finish)
