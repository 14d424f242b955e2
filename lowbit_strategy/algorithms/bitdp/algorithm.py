"""BitDP behind the algorithm interface: a gradient-level :class:`~..base.Sync` whose DDP
hook is :func:`.hook.bitdp_hook`, for any optimizer."""

from __future__ import annotations

from typing import Any, cast

import torch

from lowbit_strategy.algorithms.base import Algorithm, Sync
from lowbit_strategy.algorithms.bitdp import local_state
from lowbit_strategy.algorithms.bitdp.config import BitDPConfig
from lowbit_strategy.algorithms.bitdp.hierarchical import hierarchical_hook
from lowbit_strategy.algorithms.bitdp.hook import BitDPState, bitdp_hook
from lowbit_strategy.algorithms.bitdp.sharded import sharded_ready
from lowbit_strategy.collectives.wire import TrafficLog
from lowbit_strategy.layout import local_view


class BitDPSync(Sync):
    """Registers :func:`bitdp_hook` (across nodes :func:`.hierarchical.hierarchical_hook`);
    its state (iteration count, error-feedback residuals, two-stage server errors) is the
    rank-local state checkpoints keep."""

    level = "gradient"

    def __init__(self, config, module: torch.nn.Module, group=None):
        super().__init__(config, group)
        section: BitDPConfig = config.bitdp
        self.state = BitDPState(
            bits=section.bits,
            process_group=group,
            quantize=section.quantize,
            exclude=section.exclude,
            start_iter=max(2, config.warmup_steps),
            reduction=section.reduction,
            error_feedback=section.error_feedback,
            traffic=TrafficLog(),
            form=section.form,
            link=config.link,
            warmup_wire=config.exact_wire,
        ).attach(module)
        self._module = module
        #: the sharded path's units (by their parameters) and those seen in this backward pass
        self._units: dict[tuple[int, ...], int] = {}
        self._seen: set[int] = set()

    @property
    def hierarchical(self) -> bool:
        return self.topology is not None and self.topology.hierarchical

    @property
    def hook_state(self):
        topology = self.topology
        if topology is not None and topology.hierarchical:
            # the hook needs the topology too; BitDP's own collectives run across nodes
            self.state.process_group = topology.inter
            return self
        return self.state

    @property
    def comm_hook(self):
        return hierarchical_hook if self.hierarchical else bitdp_hook

    def gradients_ready(self, params, flat):
        """The sharded path's launch site (FSDP2's per-unit hook; DDP uses :attr:`comm_hook`):
        the unit's gradient shard through BitDP across nodes (:mod:`.sharded`), in place."""
        if self.spec.world_size == 1:  # one node: FSDP's node mean is the result, nothing is compressed
            return None
        self.state.process_group = self.spec.group  # the ranks holding the same shard on every node
        if not self.state.local_shapes:
            self.state.local_shapes = {id(p): tuple(local_view(p).shape) for p in self._module.parameters()}
        per_node = cast(Any, params[0]).device_mesh.size() if params else 1
        return sharded_ready(self.state, self._units, self._seen, params, flat, per_node)

    def traffic_logs(self) -> list[TrafficLog]:
        return [self.state.traffic, self.node_traffic]

    def algorithm_state_dict(self) -> dict:
        return self.state.state_dict()

    def load_algorithm_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)


def merge_states(states: list[dict]) -> dict:
    """BitDP hook state for another world size: rank 0's iteration count and the mean
    residual, which carries the same untransmitted part of the mean gradient
    (Σ_r e_r / P) into every new rank; the two-stage server errors restart at zero (each
    belonged to one rank's chunk, and the chunks change with the world size)."""
    names = set.intersection(*(set(s["residuals"]) for s in states))
    return {
        "format": local_state.FORMAT,
        "iter": states[0]["iter"],
        "residuals": {n: torch.stack([s["residuals"][n] for s in states]).mean(0) for n in sorted(names)},
        "server_errors": {},
    }


ALGORITHM = Algorithm(
    name="bitdp",
    section=BitDPConfig,
    build=BitDPSync,
    strategy_names={
        "lowbit_bitdp": dict(algorithm="bitdp", bits=2),
        "lowbit_bitdp_1bit": dict(algorithm="bitdp", bits=1),
    },
    merge_states=merge_states,
    summary="BitDP channel-wise 1/2-bit gradients (any optimizer)",
    hierarchical=True,
    sharded=True,
)
