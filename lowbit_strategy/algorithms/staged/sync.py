"""The staged optimizers behind the algorithm interface: one :class:`~lowbit_strategy.algorithms.base.Sync`
for every :class:`~lowbit_strategy.algorithms.staged.optimizer.StagedOptimizer`
(:mod:`lowbit_strategy.algorithms.staged`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import cast

import torch

from lowbit_strategy.algorithms.base import LowBitSetupError, Sync, local_gradients_precision
from lowbit_strategy.algorithms.staged.communicator import BucketCommunicator
from lowbit_strategy.algorithms.staged.optimizer import StagedOptimizer
from lowbit_strategy.algorithms.staged.warmup_codes import CodedWarmup
from lowbit_strategy.collectives import chain, wire
from lowbit_strategy.collectives.exact import mean_allreduce_async, wire_dtype_of
from lowbit_strategy.collectives.shards import Whole, take
from lowbit_strategy.layout import dtensor_state_, parameter_names
from lowbit_strategy.rank_state import to_cpu

logger = logging.getLogger(__name__)


class StagedSync(Sync):
    """One optimizer-level :class:`~.base.Sync` for every :class:`StagedOptimizer`.

    Its DDP hook is the one the package docstring describes (:mod:`lowbit_strategy.algorithms.staged`,
    "The DDP hook": DDP's mean during warm-up, then local gradients and, with ``overlap``,
    collectives started during backward). Rank-local state in checkpoints: each optimizer's
    ``state`` and its communicator's per-bucket state. Subclasses set :attr:`optimizer_class`,
    :attr:`algorithm_name` and implement :meth:`make_communicator`.
    """

    level = "optimizer"
    #: the optimizer class this algorithm drives
    optimizer_class: type = StagedOptimizer
    algorithm_name = ""
    #: how the optimizer's arguments are described in the wrong-optimizer error
    arguments_hint = ""

    def __init__(self, config, module: torch.nn.Module, group=None):
        super().__init__(config, group)
        self.section = getattr(config, self.algorithm_name)
        self.overlap = self.section.overlap
        self.optimizers: list[StagedOptimizer] = []
        self._owner: dict[int, StagedOptimizer] = {}
        self._hook_traffic = wire.TrafficLog()
        #: parameter names, for checkpoints keyed by name
        self._names = parameter_names(module)
        #: the warm-up's BitDP codes (``warmup_wire="int2"``), else None
        self._coded = (
            CodedWarmup(config, module, self._hook_traffic, self.node_traffic) if config.warmup_wire == "int2" else None
        )

    def make_communicator(self, optimizer: StagedOptimizer) -> BucketCommunicator:
        raise NotImplementedError

    def gradients_ready(self, params, flat):
        """During warm-up (or when every bucket is exact) the mean of ``flat``; afterwards the
        gradients stay local and, with ``overlap``, each owning optimizer starts the buckets
        of its layout that are now complete."""
        owners = self._owners(params)
        wire = self._averaged_in(owners)
        if wire == "int2":
            assert self._coded is not None
            return self._coded.mean(self.spec, self.topology, params, flat, owners[0].global_step)
        if self._coded is not None and self._coded.state.residuals:
            self._coded.end()
        if wire is not None:
            return self._warmup_mean(flat, wire)
        if not self.launch_after_assignment:
            self._launch(owners, params)
        return None

    def launch_ready(self, params, flat):
        """With overlap, in the compression stage, each owning optimizer starts the buckets of
        its layout whose gradients are now all in ``p.grad`` (the sharded path: after FSDP
        assigned them; warm-up and exact buckets were averaged at :meth:`gradients_ready`)."""
        owners = self._owners(params)
        if self._averaged_in(owners) is None:
            self._launch(owners, params)

    def _owners(self, params) -> list[StagedOptimizer]:
        return [opt for opt in self.optimizers if any(self._owner.get(id(p)) is opt for p in params)]

    def _averaged_in(self, owners: list[StagedOptimizer]) -> str | None:
        """The wire the launch site averages these gradients in, or None (they stay local):
        during warm-up (or with no owner) the config's ``warmup_wire`` (torch's
        ``bf16_compress_hook``'s mean by default; ``int2``: :class:`.CodedWarmup`'s, with no
        owner the exact wire); for a communicator whose every bucket is the exact mean, DDP's
        mean in that communicator's wire."""
        if not owners:
            return self.config.exact_wire
        if any(opt.stage == "warmup" for opt in owners):
            return self.config.warmup_wire
        exact = [opt.communicator for opt in owners if opt.communicator is not None and opt.communicator.exact]
        return exact[0].exact_wire if exact else None

    def _launch(self, owners: list[StagedOptimizer], params) -> None:
        if self.overlap:
            for opt in owners:  # the same order on every rank
                if opt._distributed:
                    opt.grads_ready([p for p in params if self._owner.get(id(p)) is opt])

    def _warmup_mean(self, buf: torch.Tensor, wire: str) -> torch.futures.Future:
        """The bucket's mean over ranks, as DDP computes it with ``wire`` on the wire (``fp32``:
        DDP's own; ``bf16``: torch's ``bf16_compress_hook``'s,
        :func:`~lowbit_strategy.collectives.exact.mean_allreduce_async`). Across nodes the hook
        has averaged it over the node already, exactly: each rank averages its part
        (:attr:`spec`) over the spec's group (N workers) and the spec restores the bucket
        exactly inside the node."""
        spec, dtype, op = self.spec, wire_dtype_of(wire), f"staged.warmup.{wire}"
        if isinstance(spec, Whole):
            return mean_allreduce_async(buf, self.group, op, self._hook_traffic, dtype)
        part = take(spec, buf)
        # waited here, not chained: the node's all-gather is a second collective, launched
        # in hook order on every rank, never from a future's callback
        mean_allreduce_async(part, spec.group, op, self._hook_traffic, dtype).wait()
        restored = spec.restore_async(part, buf.numel(), self._hook_traffic)
        return chain.then(restored, lambda f: buf.copy_(f.value()[0]))

    def disable_overlap(self, reason: str) -> None:
        if self.overlap:
            logger.info(
                "lowbit: %s synchronizes momenta in optimizer.step(), not during backward: %s "
                "(during warm-up gradients are averaged during backward either way)",
                self.optimizer_class.__name__,
                reason,
            )
        self.overlap = False

    def attach(self, optimizers: Sequence[torch.optim.Optimizer], who: str = "") -> None:
        cls = self.optimizer_class
        for opt in optimizers:
            if type(opt) is not cls:
                raise LowBitSetupError(
                    f"{who or f'LowBitConfig(algorithm={self.algorithm_name})'} drives lowbit_strategy.{cls.__name__}, "
                    f"but got {type(opt).__module__}.{type(opt).__name__}. Use lowbit_strategy.{cls.__name__}(...)"
                    f"{self.arguments_hint}, or plain DDP / algorithm='bitdp' for other optimizers."
                )
        self.optimizers = cast(list[StagedOptimizer], list(optimizers))  # each is optimizer_class: checked above
        self._owner = {id(p): opt for opt in self.optimizers for grp in opt.param_groups for p in grp["params"]}
        for opt in self.optimizers:
            opt.attach_communicator(self.make_communicator(opt), self._names)

    def detach(self) -> None:
        self._owner = {}
        for opt in self.optimizers:
            opt.attach_communicator(None)

    def traffic_logs(self) -> list[wire.TrafficLog]:
        return [self._hook_traffic, self.node_traffic] + [
            opt.communicator.traffic for opt in self.optimizers if opt.communicator is not None
        ]

    def algorithm_state_dict(self) -> dict:
        state: dict = {
            "optimizers": [
                {
                    "state": to_cpu(opt.state_dict()["state"]),
                    "errors": opt.communicator.state_dict() if opt.communicator else {},
                }
                for opt in self.optimizers
            ]
        }
        if self._coded is not None:
            state["warmup_codes"] = self._coded.state_dict()
        return state

    def load_algorithm_state_dict(self, state: dict) -> None:
        saved = state.get("optimizers", [])
        if len(saved) != len(self.optimizers):
            raise ValueError(
                f"{self.optimizer_class.__name__} state holds {len(saved)} optimizers, the run has "
                f"{len(self.optimizers)}"
            )
        for opt, own in zip(self.optimizers, saved):
            opt.load_state_dict({**opt.state_dict(), "state": own["state"]})
            dtensor_state_(opt)  # sharded: local shards back to DTensors like their parameters
            if opt.communicator is not None:
                device = next((p.device for grp in opt.param_groups for p in grp["params"]), "cpu")
                opt.communicator.load_state_dict(own.get("errors") or {}, device)
        if self._coded is not None:  # (absent: another world size, or saved with another warmup_wire)
            self._coded.load_state_dict(state.get("warmup_codes") or {"iter": 0})


#: ``16-mixed`` refused: in the compression stage gradients stay local
check_local_gradient_precision = local_gradients_precision("1-bit Adam/LAMB and TurboQuantAdamW")


def rank0_state_without_errors(states: list[dict]) -> dict:
    """Another world size: the optimizer state of rank 0 and no per-bucket communicator state
    (it describes parts of buckets at the old world size; error feedback restarts from 0).
    Rank 0's optimizer state stands for every rank's only when every saved rank had the same
    layout (whole parameters, a replicated run): per-shard state (the saved ranks' layouts
    differ) is refused, naming why."""
    layouts = [[(own.get("errors") or {}).get("layout") for own in s["optimizers"]] for s in states]
    if any(lay != layouts[0] for lay in layouts[1:]):
        raise ValueError(
            "the optimizer state was saved by ranks holding different shards of the parameters: it cannot be "
            "merged into another world size; resume at the world size and sharding it was saved with"
        )
    return {"optimizers": [{"state": own["state"], "errors": {}} for own in states[0]["optimizers"]]}
