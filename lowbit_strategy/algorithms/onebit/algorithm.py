"""1-bit Adam and 1-bit LAMB behind the algorithm interface: one optimizer-level
:class:`~..base.Sync` for both.

The DDP hook does what the optimizer's stage needs: during warm-up it averages the bucket in
full precision exactly as DDP does (``torch.optim.AdamW`` on DDP gradients, bit for bit);
in the compression stage it keeps the gradients local and, with ``overlap`` (the default),
tells the optimizer which gradients are ready; the optimizer forms this rank's momenta of
every fused buffer of its own layout that is complete and starts its compressed allreduce
while backward goes on. Rank-local state in checkpoints: each
optimizer's ``state`` (the same on every rank, but cheap) and its communicator's worker
and server errors (different on every rank).
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

import torch

from lowbit_strategy.algorithms.base import Algorithm, LowBitSetupError, Sync
from lowbit_strategy.algorithms.onebit.communicator import OneBitCommunicator
from lowbit_strategy.algorithms.onebit.config import OneBitAdamConfig, OneBitLambConfig
from lowbit_strategy.algorithms.onebit.optimizer import OneBitAdam, OneBitLamb, _OneBitOptimizer
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.wire import TrafficLog
from lowbit_strategy.rank_state import to_cpu

logger = logging.getLogger(__name__)


def _mean_allreduce(buf: torch.Tensor, group, traffic) -> torch.futures.Future:
    """DDP's own averaging of a bucket, bit for bit: scale by 1/P (a multiply, as DDP's
    reducer does), then a SUM allreduce."""
    buf.mul_(1.0 / g.world_size(group))
    return g.all_reduce_sum_async(buf, group, "onebit.warmup.allreduce", traffic)


class OneBitSync(Sync):
    level = "optimizer"
    #: the optimizer class this algorithm drives (set by the subclasses)
    optimizer_class: type = _OneBitOptimizer

    def __init__(self, config, module: torch.nn.Module, group=None):
        super().__init__(config, group)
        self.section = getattr(config, self.algorithm_name)
        self.overlap = self.section.overlap
        self.optimizers: list[_OneBitOptimizer] = []
        self._owner: dict[int, _OneBitOptimizer] = {}
        self._hook_traffic = TrafficLog()

    algorithm_name = ""

    def bucket_ready(self, bucket):
        params = bucket.parameters()
        owners = [opt for opt in self.optimizers if any(self._owner.get(id(p)) is opt for p in params)]
        if any(opt.stage == "warmup" for opt in owners) or not owners:
            return _mean_allreduce(bucket.buffer(), self.group, self._hook_traffic)
        if self.overlap:
            for opt in owners:  # the same order on every rank
                if opt._distributed:
                    opt.grads_ready([p for p in params if self._owner.get(id(p)) is opt])
        return super().bucket_ready(bucket)

    def disable_overlap(self, reason: str) -> None:
        if self.overlap:
            logger.info("lowbit: %s synchronizes momenta in optimizer.step(), not during backward: %s "
                        "(during warm-up gradients are averaged during backward either way)",
                        self.optimizer_class.__name__, reason)
        self.overlap = False

    def attach(self, optimizers: Sequence[torch.optim.Optimizer], who: str = "") -> None:
        cls = self.optimizer_class
        for opt in optimizers:
            if type(opt) is not cls:
                raise LowBitSetupError(
                    f"{who or f'LowBitConfig(algorithm={self.algorithm_name})'} drives lowbit_strategy.{cls.__name__}, "
                    f"but got {type(opt).__module__}.{type(opt).__name__}. Use lowbit_strategy.{cls.__name__}(...) "
                    "(same arguments as DeepSpeed's), or plain DDP / algorithm='bitdp' for other optimizers."
                )
        self.optimizers = list(optimizers)
        self._owner = {id(p): opt for opt in self.optimizers for grp in opt.param_groups for p in grp["params"]}
        for opt in self.optimizers:
            opt.attach_communicator(OneBitCommunicator(self.group, self.config.bucket_size_mb, self.config.debug,
                                                       block=self.section.scale_block))

    def detach(self) -> None:
        self._owner = {}
        for opt in self.optimizers:
            opt.attach_communicator(None)

    def traffic_logs(self) -> list[TrafficLog]:
        return [self._hook_traffic] + [opt.communicator.traffic for opt in self.optimizers
                                       if opt.communicator is not None]

    def state_dict(self) -> dict:
        return {"optimizers": [{"state": to_cpu(opt.state_dict()["state"]),
                                "errors": opt.communicator.state_dict() if opt.communicator else {}}
                               for opt in self.optimizers]}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("optimizers", [])
        if len(saved) != len(self.optimizers):
            raise ValueError(f"{self.optimizer_class.__name__} state holds {len(saved)} optimizers, the run has "
                             f"{len(self.optimizers)}")
        for opt, own in zip(self.optimizers, saved):
            opt.load_state_dict({**opt.state_dict(), "state": own["state"]})
            if opt.communicator is not None:
                device = next((p.device for grp in opt.param_groups for p in grp["params"]), "cpu")
                opt.communicator.load_state_dict(own.get("errors") or {}, device)


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
    return {"optimizers": [{"state": own["state"], "errors": {}} for own in states[0]["optimizers"]]}


def check_precision(precision: Optional[str]) -> None:
    if precision == "16-mixed":
        raise LowBitSetupError(
            "1-bit Adam/LAMB do not support precision='16-mixed': in the compression stage gradients stay "
            "local, so each rank's GradScaler could skip a different step and the ranks would hang. Use "
            "precision='bf16-mixed' or '32-true' (the optimizers skip non-finite steps on all ranks together)."
        )


def _entry(name: str, section, sync, strategy: str, summary: str) -> Algorithm:
    return Algorithm(name=name, section=section, build=sync, strategy_names={strategy: dict(algorithm=name)},
                     merge_states=merge_states, check_precision=check_precision, summary=summary)


ADAM = _entry("onebit_adam", OneBitAdamConfig, OneBitAdamSync, "lowbit_adam", "1-bit Adam (lowbit_strategy.OneBitAdam)")
LAMB = _entry("onebit_lamb", OneBitLambConfig, OneBitLambSync, "lowbit_lamb", "1-bit LAMB (lowbit_strategy.OneBitLamb)")
