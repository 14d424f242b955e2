"""1-bit Adam and 1-bit LAMB behind the algorithm interface: one optimizer-level
:class:`~..base.Sync` for both.

The DDP hook is the staged optimizers' (:mod:`lowbit_strategy.algorithms.staged`, "The DDP
hook": DDP's mean during warm-up, then the compressed allreduce of the momenta, started
during backward with ``overlap``). Rank-local state in checkpoints: each optimizer's
``state`` (the same on every rank, but cheap) and its communicator's worker and server
errors (different on every rank).
"""

from __future__ import annotations

from lowbit_strategy.algorithms.base import Algorithm
from lowbit_strategy.algorithms.onebit.adam import OneBitAdam
from lowbit_strategy.algorithms.onebit.communicator import OneBitCommunicator
from lowbit_strategy.algorithms.onebit.config import OneBitAdamConfig, OneBitLambConfig
from lowbit_strategy.algorithms.onebit.lamb import OneBitLamb
from lowbit_strategy.algorithms.onebit.optimizer import OneBitOptimizer
from lowbit_strategy.algorithms.staged import StagedSync, check_local_gradient_precision, rank0_state_without_errors


class OneBitSync(StagedSync):
    optimizer_class: type = OneBitOptimizer
    arguments_hint = " (same arguments as DeepSpeed's)"

    def make_communicator(self, optimizer) -> OneBitCommunicator:
        return OneBitCommunicator(
            self.group,
            self.config.bucket_size_mb,
            self.config.debug,
            block=self.section.scale_block,
            topology=self.topology,
            spec=self.spec,
        )


class OneBitAdamSync(OneBitSync):
    optimizer_class = OneBitAdam
    algorithm_name = "onebit_adam"


class OneBitLambSync(OneBitSync):
    optimizer_class = OneBitLamb
    algorithm_name = "onebit_lamb"


def merge_states(states: list[dict]) -> dict:
    """Another world size: the optimizer state of rank 0 (moments, frozen variance and LAMB
    coefficients are the same on every rank) and no error buffers (the server errors
    describe chunks of the old world size; error feedback restarts from 0)."""
    return rank0_state_without_errors(states)


def _entry(name: str, section, sync, strategy: str, summary: str, sharded: bool) -> Algorithm:
    return Algorithm(
        name=name,
        section=section,
        build=sync,
        strategy_names={strategy: dict(algorithm=name)},
        merge_states=merge_states,
        check_precision=check_local_gradient_precision,
        summary=summary,
        optimizer=sync.optimizer_class,
        hierarchical=True,
        sharded=sharded,
        warmup_argument="freeze_step",
        coded_warmup=True,
    )


ADAM = _entry(
    "onebit_adam", OneBitAdamConfig, OneBitAdamSync, "lowbit_adam", "1-bit Adam (lowbit_strategy.OneBitAdam)", True
)
# sharded, its trust ratios and r are the whole parameters' (node reductions of the shards')
LAMB = _entry(
    "onebit_lamb", OneBitLambConfig, OneBitLambSync, "lowbit_lamb", "1-bit LAMB (lowbit_strategy.OneBitLamb)", True
)
