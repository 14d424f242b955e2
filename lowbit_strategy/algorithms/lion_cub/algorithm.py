"""Lion Cub behind the algorithm interface: an optimizer-level :class:`~..base.Sync`.

Gradients stay local: the DDP hook returns each bucket untouched. With ``overlap`` (the
default) the hook also hands the bucket to its :class:`Lion`, which forms the update
vectors c from the local gradients and its momenta and starts the bucket's compressed
collective at once, while backward goes on; ``step()`` waits for the results and applies
them. Without it, each :class:`Lion` synchronizes everything in ``step()``. The rank-local
state checkpoints keep is every optimizer's ``state`` (each rank's own momenta).

Across nodes (``topology``) the hook first averages each bucket over the node's ranks
(:func:`~lowbit_strategy.algorithms.ddp_hook.bucket_hook`), so the momenta belong to the node,
and the communicator sends each local rank's shard across nodes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lowbit_strategy.algorithms.base import Algorithm, LowBitSetupError, Sync, local_gradients_precision
from lowbit_strategy.algorithms.lion_cub.communicator import LionCommunicator
from lowbit_strategy.algorithms.lion_cub.config import LionConfig
from lowbit_strategy.algorithms.lion_cub.optimizer import Lion
from lowbit_strategy.algorithms.lion_cub.synced_momenta import momentum_sync_params
from lowbit_strategy.codecs.reduce import nonfinite_flag
from lowbit_strategy.collectives.wire import TrafficLog
from lowbit_strategy.layout import dtensor_state_, local_view, parameter_names
from lowbit_strategy.rank_state import mean_states, to_cpu

logger = logging.getLogger(__name__)


class LionSync(Sync):
    level = "optimizer"

    def __init__(self, config, module: torch.nn.Module, group=None):
        super().__init__(config, group)
        section: LionConfig = config.lion
        # checked even when unused: a pattern matching no parameter is an error at setup, not when
        # momentum sync is switched on later
        selected = momentum_sync_params(module, section.momentum_sync_layers)
        self.momentum_params = selected if section.momentum_sync_every else []
        self.optimizers: list[Lion] = []
        self._traffic: list[TrafficLog] = []
        self.overlap = section.overlap
        self._owner: dict[int, Lion] = {}
        #: parameter names, for checkpoints keyed by name
        self._names = parameter_names(module)

    def gradients_ready(self, params, flat):
        """Keep the gradients local; with overlap, start the collective of ``params`` now
        (unless the launch site assigns gradients later: then at :meth:`launch_ready`)."""
        if not self.launch_after_assignment:
            self.launch_ready(params, flat)
        return None

    def launch_ready(self, params, flat):
        """With overlap, form the update vectors of ``params`` from their gradients and start
        their collective (:meth:`Lion.launch_bucket`)."""
        if self.overlap and self._owner:
            nonfinite = nonfinite_flag(flat)  # stays on the device: no host sync here
            for opt in self.optimizers:  # the same order on every rank
                # local_view: a DTensor's shard (FSDP2); an empty shard has nothing to send
                mine = [p for p in params if self._owner.get(id(p)) is opt and local_view(p).numel()]
                if mine and opt.communicator is not None and opt.communicator.world_size > 1:
                    # p.grad, not views of the buffer: it holds this rank's gradient in the
                    # parameter's own layout (a channels_last weight's bucket view would not);
                    # a parameter unused on this rank counts as a zero gradient
                    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in mine]
                    opt.launch_bucket(mine, grads, nonfinite)

    def disable_overlap(self, reason: str) -> None:
        if self.overlap:
            logger.info("lowbit: Lion Cub synchronizes in optimizer.step(), not during backward: %s", reason)
        self.overlap = False

    def attach(self, optimizers: Sequence[torch.optim.Optimizer], who: str = "") -> None:
        lions: list[Lion] = []
        for opt in optimizers:
            if not isinstance(opt, Lion):
                raise LowBitSetupError(
                    f"{who or 'LowBitConfig(algorithm=lion)'} drives lowbit_strategy.Lion, "
                    f"but got {type(opt).__module__}.{type(opt).__name__}. "
                    "Use lowbit_strategy.Lion(...) instead, or algorithm='bitdp' (strategy 'lowbit_bitdp') / "
                    "plain DDP for other optimizers (their gradients would otherwise never be synchronized)."
                )
            lions.append(opt)
        self.optimizers = lions
        self._owner = {id(p): opt for opt in self.optimizers for grp in opt.param_groups for p in grp["params"]}
        self._traffic = []
        section = self.config.lion
        for opt in self.optimizers:
            comm = LionCommunicator(self.config, group=self.group, topology=self.topology, spec=self.spec)
            opt.attach_communicator(comm, self._names)
            self._traffic.append(comm.traffic)
            if section.momentum_sync_every:
                opt.set_momentum_sync(section.momentum_sync_every, self.momentum_params)
            params = [p for grp in opt.param_groups for p in grp["params"]]
            # every rank, same order: auto measures its codecs once and plans with them
            comm.calibrate(
                sum(local_view(p).numel() for p in params),  # what this rank holds (a DTensor's shard)
                section.momentum_sync_every,
                params[0].device if params else "cpu",
            )

    def detach(self) -> None:
        self._owner = {}
        for opt in self.optimizers:
            opt.attach_communicator(None)
            opt.set_momentum_sync(0, [])

    def traffic_logs(self) -> list[TrafficLog]:
        return [*self._traffic, self.node_traffic]

    def algorithm_state_dict(self) -> dict:
        """Format 2: every optimizer's ``state`` (this rank's momenta) and its layout
        (parameter names and local shapes), which :func:`merge_states` reads."""
        return {
            "format": 2,
            "layouts": [opt.param_layout.describe() if opt.param_layout else None for opt in self.optimizers],
            "optimizers": [to_cpu(opt.state_dict()["state"]) for opt in self.optimizers],
            # the auto mode each communicator resolved (a measurement: kept so a resume continues alike)
            "plans": [opt.communicator.plan_state() if opt.communicator else None for opt in self.optimizers],
        }

    def load_algorithm_state_dict(self, state: dict) -> None:
        """Format 2, or format 1 (``{"optimizers": [...]}``, no layout); momenta saved for
        parameters of other local shapes raise, naming the parameter."""
        saved = state.get("optimizers", [])
        if len(saved) != len(self.optimizers):
            raise ValueError(
                f"Lion Cub state holds {len(saved)} optimizers' momenta, the run has {len(self.optimizers)}"
            )
        for i, (opt, own) in enumerate(zip(self.optimizers, saved)):
            layout = (state.get("layouts") or [None] * len(saved))[i]
            if layout is not None and opt.param_layout is not None:
                _check_shapes(layout["shapes"], opt.param_layout.describe()["shapes"])
            # torch's load_state_dict moves each buffer to its parameter's device
            opt.load_state_dict({**opt.state_dict(), "state": own})
            if opt.communicator is not None:
                opt.communicator.restore_plan((state.get("plans") or [None] * len(saved))[i])
            dtensor_state_(opt)  # sharded: local shards back to DTensors like their parameters


def _check_shapes(saved: dict, mine: dict) -> None:
    if saved != mine:
        diff = sorted(k for k in set(saved) | set(mine) if saved.get(k) != mine.get(k))
        raise ValueError(
            f"Lion Cub state was saved for other parameters or local shapes ({diff[:4]}: saved "
            f"{[saved.get(k) for k in diff[:4]]}, the run has {[mine.get(k) for k in diff[:4]]}): "
            "resume with the model and sharding it was saved with"
        )


def merge_states(states: list[dict]) -> dict:
    """Momenta for another world size: each one's mean over the saved ranks, the consensus
    every rank would reach after a full momentum sync. Only for momenta of whole parameters,
    the same layout on every saved rank (a replicated run); per-shard momenta (ranks with
    different local shapes) are refused, naming why."""
    layouts = [s.get("layouts") for s in states]
    if any(lay != layouts[0] for lay in layouts[1:]):
        raise ValueError(
            "Lion Cub state was saved by ranks holding different shards of the parameters: it cannot be "
            "averaged into another world size; resume at the world size and sharding it was saved with"
        )
    merged = [mean_states(per_rank, "Lion Cub state") for per_rank in zip(*(s["optimizers"] for s in states))]
    return {"format": 2, "layouts": layouts[0], "optimizers": merged}


ALGORITHM = Algorithm(
    name="lion",
    section=LionConfig,
    build=LionSync,
    strategy_names={
        "lowbit_lion": dict(algorithm="lion", mode="auto"),
        "lowbit_lion_1bit": dict(algorithm="lion", mode="1bit"),
        "lowbit_lion_4bit": dict(algorithm="lion", mode="sign", bits=4),
        "lowbit_lion_8bit": dict(algorithm="lion", mode="lp", bits=8, p=1.0),
        "lowbit_lion_fp32": dict(algorithm="lion", mode="fp32"),
    },
    merge_states=merge_states,
    check_precision=local_gradients_precision("Lion Cub's optimizers"),
    summary="Lion Cub (lowbit_strategy.Lion)",
    optimizer=Lion,
    hierarchical=True,
    sharded=True,
)
