"""The DDP adapter: DDP's communication hook turns a ``GradBucket`` into the neutral
"these parameters' gradients are ready" of the algorithm interface.

An algorithm sees parameters and local tensors (:meth:`Sync.gradients_ready`), never a
``dist.GradBucket``: the same algorithm then serves DDP's buckets and any other launch site
(a sharded path's per-unit hook hands over a unit's parameters and its gradient shard). This
module is where DDP's shape stops:

* the hierarchical form's first stage (the node's exact mean of the bucket, in place, and of
  every ``.grad`` that is not a view of it: what the optimizer reads), so the node's ranks
  hold the same gradient and their algorithm state stays the same;
* ``sync.gradients_ready(bucket.parameters(), bucket.buffer())``: a future of the averaged
  buffer when the algorithm averages now (the staged optimizers' warm-up), or None to keep
  every rank's own gradient (:func:`keep_local_gradients`).

Gradient-level algorithms (BitDP) register a DDP hook of their own (``Sync.comm_hook``):
what they return *is* DDP's averaged bucket.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook inspects the hook's
# annotations and accepts only the real dist.GradBucket / Future[Tensor] objects.
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["bucket_hook", "keep_local_gradients"]


def bucket_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook of optimizer-level algorithms (``state``: the run's ``Sync``;
    a plain function: DDP wants a function, not a bound method)."""
    topology = state.topology
    if topology is not None and topology.hierarchical:
        buf = bucket.buffer()
        topology.node_mean_(buf, state.node_traffic)
        for p, view in zip(bucket.parameters(), bucket.gradients()):
            if p.grad is not None and p.grad.data_ptr() != view.data_ptr():
                p.grad.copy_(view)
    averaged = state.gradients_ready(bucket.parameters(), bucket.buffer())
    return averaged if averaged is not None else keep_local_gradients(state, bucket)


def keep_local_gradients(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that sends nothing: each rank keeps its own gradient (for a
    model whose optimizer synchronizes by itself)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut
