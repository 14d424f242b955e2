"""TurboQuant-Adam behind the algorithm interface: the optimizer-level
:class:`~lowbit_strategy.algorithms.staged.StagedSync` for :class:`TurboQuantAdamW`.

The DDP hook is the staged optimizers' (:mod:`lowbit_strategy.algorithms.staged`, "The DDP
hook": DDP's mean during warm-up, then each fused momentum buffer's TurboQuant collective,
started during backward with ``overlap``). Rank-local state in checkpoints: each
optimizer's ``state`` (``exp_avg`` the same on every rank; ``exp_avg_sq`` too under
``variance="synchronized"``, per rank under ``"local"``) and its communicator's per-bucket
worker error, server error and scale EMA.
"""

from __future__ import annotations

from typing import cast

from lowbit_strategy.algorithms.base import Algorithm
from lowbit_strategy.algorithms.staged import (
    StagedOptimizer,
    StagedSync,
    check_local_gradient_precision,
    rank0_state_without_errors,
)
from lowbit_strategy.algorithms.turboquant.communicator import TurboQuantCommunicator
from lowbit_strategy.algorithms.turboquant.config import TurboQuantConfig
from lowbit_strategy.algorithms.turboquant.optimizer import TurboQuantAdamW
from lowbit_strategy.layout import Layout


class TurboQuantSync(StagedSync):
    optimizer_class = TurboQuantAdamW
    algorithm_name = "turboquant"
    arguments_hint = " (same arguments as torch.optim.AdamW, plus bits and warmup_steps)"

    def make_communicator(self, optimizer: StagedOptimizer) -> TurboQuantCommunicator:
        cfg, section = self.config, self.section
        optimizer = cast(TurboQuantAdamW, optimizer)  # attach() admits only optimizer_class
        return TurboQuantCommunicator(
            self.group,
            cfg.bucket_size_mb,
            cfg.debug,
            bits=optimizer.bits,
            form=section.form,
            block=section.block,
            seed=section.seed,
            scale_decay=optimizer.scale_decay,
            link=cfg.link,
            topology=self.topology,
            spec=self.spec,
            fallback=cfg.exact_wire,
        )

    def attach(self, optimizers, who: str = "") -> None:
        super().attach(optimizers, who)
        for opt in self.optimizers:  # every rank, same order: auto measures its codec once
            params = [p for grp in opt.param_groups for p in grp["params"]]
            comm = cast(TurboQuantCommunicator, opt.communicator)
            comm.calibrate(params[0].device if params else "cpu")
            if comm.world_size > 1:
                layout = opt.layout()
                comm.plan_forms(layout, [cast(Layout, opt.param_layout).numel(key) for key in layout])


def merge_states(states: list[dict]) -> dict:
    """Another world size: the optimizer state of rank 0 (its momentum is every rank's; under
    ``variance="local"`` its variance stands in for every rank's) and no per-bucket state
    (worker and server errors and scale EMAs restart from the data)."""
    return rank0_state_without_errors(states)


ALGORITHM = Algorithm(
    name="turboquant",
    section=TurboQuantConfig,
    build=TurboQuantSync,
    strategy_names={"lowbit_turboquant": dict(algorithm="turboquant")},
    merge_states=merge_states,
    check_precision=check_local_gradient_precision,
    summary="TurboQuant-Adam: 4-bit Hadamard + Lloyd-Max momentum (lowbit_strategy.TurboQuantAdamW)",
    optimizer=TurboQuantAdamW,
    hierarchical=True,
    sharded=True,
    warmup_argument="warmup_steps",
    coded_warmup=True,
)
