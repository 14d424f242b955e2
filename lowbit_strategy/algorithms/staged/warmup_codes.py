"""The staged optimizers' warm-up in BitDP's 2-bit codes: ``LowBitConfig(warmup_wire="int2")``.

1-bit Adam and 1-bit LAMB (*1-bit LAMB*, Sec. 3: the variance is frozen after a full-precision
warm-up) and TurboQuant-Adam run plain Adam on the mean gradient for their first steps. At
100 Mbit/s between nodes those steps cost the most: with bf16 on the wire 1-bit Adam's warm-up
step takes 2.3 times its compressed step, almost half of its time to the target in this
project's time-to-quality study. ``int2`` sends them the way BitDP (*BitDP: Ultra-Low Bit
Communication for Efficient Data Parallelism in LLM Training*, Sec. 3.1-3.2) sends every
step: each linear weight's gradient channel-coded to 2 bits per element (ternary codes, one
scale per output channel, Eq. 7-9) with this rank's error feedback, all-gathered and
averaged exactly on every rank; every other gradient (biases, norms, embeddings) and the
first two steps (DDP's provisional buckets, then their rebuild) in bf16, as torch's
``bf16_compress_hook`` sends them. Inside a node the reduction stays exact, as in every
warm-up.

It *is* BitDP's hook (:mod:`lowbit_strategy.algorithms.bitdp`), not a copy: a
:class:`~lowbit_strategy.algorithms.bitdp.state.BitDPState` with ``bits=2``,
``error_feedback=True``, ``full_wire="bf16"``, run on each bucket the staged DDP adapter (or
the sharded path's per-unit hook) hands over: the flat form
(:func:`~lowbit_strategy.algorithms.bitdp.hook.bitdp_hook`), across nodes on the node's mean
(:func:`~lowbit_strategy.algorithms.bitdp.hierarchical.across_nodes`), or on a unit's
gradient shard (:func:`~lowbit_strategy.algorithms.bitdp.sharded.unit_mean`). So the warm-up
equals DDP with BitDP's hook plus AdamW, bit for bit, and depends on each parameter's own
rows only, never on DDP's bucket layout. Its iteration count is the optimizer's step count
(the first two steps in bf16), so a resume continues as the uninterrupted run did; its
residuals are kept by parameter name in the staged optimizers' checkpoint and dropped when
the warm-up ends (what they hold is a few steps' coding error of gradients the frozen
variance has already seen).

**Measured** (this project's time-to-quality study, 1-bit Adam, seeds 0-2): the warm-up
step at 100 Mbit/s takes 0.62 s instead of bf16's 1.20 s and the run reaches the target 2.48×
faster than DDP with bf16 communication (bf16 warm-up: 2.10×), but its final loss is 2.7 %
higher, likely because the variance frozen after the warm-up averages squared 2-bit codes. Hence an
option (slow links, where the warm-up dominates), not the default.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from lowbit_strategy.algorithms.bitdp.hierarchical import across_nodes
from lowbit_strategy.algorithms.bitdp.hook import BitDPState, bitdp_hook
from lowbit_strategy.algorithms.bitdp.sharded import UnitBucket, unit_mean
from lowbit_strategy.collectives.shards import LocalShard, NodeShard, ShardSpec
from lowbit_strategy.collectives.wire import TrafficLog
from lowbit_strategy.layout import local_view

__all__ = ["CodedWarmup", "CODED_STEPS_FROM"]

#: the first coded step is the third: BitDP's ``start_iter`` (its first two in bf16)
CODED_STEPS_FROM = 3


class _Bucket(UnitBucket):
    """A DDP bucket's parameters and flat buffer, as
    :meth:`~lowbit_strategy.algorithms.bitdp.state.BitDPState.plan` reads a ``dist.GradBucket``:
    each gradient a view at the running offset (DDP's layout)."""

    def gradients(self) -> list[torch.Tensor]:
        views, at = [], 0
        for p in self.parameters():
            views.append(self.buffer()[at : at + p.numel()].view(p.shape))
            at += p.numel()
        return views


class CodedWarmup:
    """BitDP's 2-bit hook for one staged run's warm-up (module docstring)."""

    def __init__(self, config, module: torch.nn.Module, traffic: TrafficLog, node_traffic: TrafficLog):
        self.module = module
        self.state = BitDPState(
            bits=2,
            start_iter=CODED_STEPS_FROM - 1,
            error_feedback=True,
            traffic=traffic,
            link=config.link,
            warmup_wire="bf16",
            full_wire="bf16",
        ).attach(module)
        self._shapes()
        #: for :func:`~lowbit_strategy.algorithms.bitdp.hierarchical.across_nodes`, which reads them off its ``sync``
        self.topology: Any = None
        self.node_traffic = node_traffic
        #: each bucket's (or unit's) index, by its parameters
        self._units: dict[tuple[int, ...], int] = {}

    def _shapes(self) -> None:
        """The shape this rank holds of each parameter (a shard's under FSDP2): residuals have it."""
        self.state.local_shapes = {id(p): tuple(local_view(p).shape) for p in self.module.parameters()}

    def mean(
        self, spec: ShardSpec, topology, params: Sequence[torch.Tensor], flat: torch.Tensor, steps_done: int
    ) -> torch.futures.Future[torch.Tensor]:
        """The mean of ``flat`` (a DDP bucket, or a unit's gradient shard under a
        :class:`LocalShard`) across the spec's workers, in place, in step ``steps_done + 1``."""
        if spec.world_size == 1:  # one worker: nothing crosses, so nothing is coded (the node's mean)
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(flat)
            return done
        state = self.state
        state.iter = steps_done  # BitDP's warm-up: steps_done < start_iter
        index = self._units.setdefault(tuple(id(p) for p in params), len(self._units))
        if isinstance(spec, LocalShard):
            state.process_group = spec.group
            per_node = cast(Any, params[0]).device_mesh.size() if params else 1
            return unit_mean(state, index, params, flat, per_node)
        bucket = _Bucket(index, flat, params)
        if isinstance(spec, NodeShard):
            state.process_group, self.topology = topology.inter, topology
            return across_nodes(self, bucket)
        state.process_group = spec.group
        return bitdp_hook(state, bucket)  # type: ignore[arg-type]

    def end(self) -> None:
        """The warm-up is over: its residuals go (a parameter's worth of float32 each)."""
        self.state.residuals.clear()
        self.state.server_errors.clear()

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._shapes()
        self.state.load_state_dict(state)
