"""LowBitAccelerator: Hugging Face Accelerate's ``Accelerator`` driving any registered algorithm.

Migrating an Accelerate script is one line::

    accelerator = LowBitAccelerator()              # was: Accelerator(); config from LOWBIT_CONFIG / LOWBIT_*
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

The front end holds no per-algorithm code. It looks ``config.algorithm`` up in
:data:`lowbit_strategy.algorithms.REGISTRY` and drives the algorithm's
:class:`~lowbit_strategy.algorithms.Sync` exactly as the plain-DDP and Lightning front ends do:

* ``__init__``: the algorithm checks the precision (Accelerate's ``mixed_precision``);
  Accelerate's DDP buckets take the config's ``bucket_size_mb`` (they are the units the
  hook compresses); a ``DistributedDataParallelKwargs(comm_hook=...)`` is refused, as a DDP
  model takes one hook and the algorithm's is registered instead. Accelerate's own
  ``comm_hook`` option cannot carry ours: it takes only its closed enum (anything else is
  silently ignored) and looks its handlers up by exact class.
* ``prepare`` (or ``prepare_model`` / ``prepare_optimizer``): each DDP model gets its
  :class:`Sync` and the algorithm's communication hook, registered on the prepared model;
  the optimizers holding its parameters (the real ones inside Accelerate's
  ``AcceleratedOptimizer``) are attached, so an optimizer the algorithm cannot drive is a
  :class:`LowBitSetupError` naming the fix, at ``prepare``.
* ``save_state`` / ``load_state``: Accelerate writes the optimizer state of the main process
  only, but momenta and error-feedback buffers differ across ranks. Every rank writes its own
  :meth:`Sync.state_dict` to ``lowbit_rank_states/model_<k>/`` (inside ``save_state``, which
  every rank calls; no rank holds another's state), the main process their index
  ``lowbit_rank_states.pt``; ``load_state`` hands each rank its own back *after* Accelerate
  has loaded rank 0's optimizer state into every rank (at another world size: the
  algorithm's merge, with a logged warning). A rank that fails to write, or cannot see what
  it must read, makes every rank raise (:mod:`lowbit_strategy.rank_state`).
* ``traffic_logs()`` / ``bytes_sent`` / ``ddp_bytes_per_step()``: the bytes on the wire and
  what DDP's fp32 allreduce would have sent.

Launching on CPUs: ``accelerate launch`` with a multi-process config starts processes that
each train alone (``DistributedType.NO``) on a machine without GPUs unless
``ACCELERATE_USE_CPU=1`` is set. :class:`LowBitAccelerator` passes ``cpu=True`` itself when
it is one of several launched processes and Accelerate finds no device backend, so they
form one gloo group (``MULTI_CPU``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedDataParallelKwargs

from lowbit_strategy import algorithms
from lowbit_strategy.algorithms.base import LowBitSetupError, Sync
from lowbit_strategy.collectives import wire
from lowbit_strategy.config import LowBitConfig
from lowbit_strategy.integrations.accelerate_checkpoints import STATE_FILE, RankStateCheckpoints
from lowbit_strategy.integrations.accelerate_launch import env_flag, has_device_backend, launched_world_size
from lowbit_strategy.integrations.accelerate_sharded import (
    ShardedModels,
    fsdp_env_off,
    is_sharded,
    switch_parameters,
    take_fsdp_plugin,
)
from lowbit_strategy.integrations.ddp import (
    attach_optimizers,
    build_sync,
    destroy_process_group_at_exit,
)

logger = logging.getLogger(__name__)

__all__ = ["LowBitAccelerator", "LowBitSetupError", "PRECISIONS", "STATE_FILE"]

#: Accelerate's ``mixed_precision`` -> the precision names ``Algorithm.check_precision`` reads
PRECISIONS = {"no": "32-true", "fp16": "16-mixed", "bf16": "bf16-mixed", "fp8": "transformer-engine"}
#: Accelerate modes that do not wrap the model in ``DistributedDataParallel``
_NOT_DDP = ("DEEPSPEED", "FSDP", "MEGATRON_LM", "XLA")


def _unwrap_compiled(model: Any) -> Any:
    return getattr(model, "_orig_mod", model)


@dataclasses.dataclass
class _Prepared:
    """One prepared model (DDP, or sharded: ``nodes`` > 0, the number of nodes its exchange
    spans): its algorithm's :class:`Sync` and the optimizers attached to it (their ids, in
    attach order)."""

    model: torch.nn.Module
    sync: Sync
    attached: list[int] = dataclasses.field(default_factory=list)
    nodes: int = 0


class LowBitAccelerator(ShardedModels, RankStateCheckpoints, Accelerator):
    """An ``Accelerator`` whose ``prepare`` sets up the configured low-bit algorithm.

    Args:
        lowbit: a :class:`LowBitConfig`, a dict of its fields or a YAML path. None reads
            the environment the launcher passes on: ``LOWBIT_CONFIG`` (a YAML path) and
            ``LOWBIT_<FIELD>`` / ``LOWBIT_<SECTION>_<FIELD>`` overrides.
        overlap: let optimizer-level algorithms start their collectives from the DDP hook,
            during backward (the default). Pass ``False`` when the script changes gradients
            between ``backward`` and ``optimizer.step()`` (``clip_grad_norm_``,
            ``clip_grad_value_``, manual scaling): the synchronized update is then formed
            in ``step()`` from the changed gradients. An overlapping optimizer-level
            algorithm refuses ``clip_grad_*`` with a :class:`LowBitSetupError` saying so:
            by then it has already used the unclipped gradients.
        **accelerator_kwargs: everything ``accelerate.Accelerator`` takes.

    Gradient accumulation (``accelerator.accumulate``) synchronizes once per optimizer
    step, as the Lightning strategy does: DDP's ``no_sync`` skips the hook on the other
    micro-batches and ``AcceleratedOptimizer.step`` runs only when ``sync_gradients``.
    Optimizer-level algorithms keep gradients local, so clipping clips each rank's
    *local* gradient.
    """

    #: Accelerate's DDP kwargs handler (None: none given); :meth:`_configure_ddp_kwargs` always sets one
    ddp_handler: DistributedDataParallelKwargs | None

    def __init__(
        self,
        lowbit: LowBitConfig | Mapping[str, Any] | str | os.PathLike | None = None,
        *,
        overlap: bool = True,
        **accelerator_kwargs: Any,
    ) -> None:
        self.lowbit_config = LowBitConfig.from_env() if lowbit is None else LowBitConfig.coerce(lowbit)
        self.lowbit_algorithm = algorithms.get(self.lowbit_config.algorithm)
        if not isinstance(overlap, bool):
            raise TypeError(f"LowBitAccelerator(overlap=...) must be True or False, got {overlap!r}")
        self.lowbit_overlap = overlap
        #: why ``overlap`` is off, in the algorithm's log line (front ends built on this one say theirs)
        self.lowbit_overlap_reason = "LowBitAccelerator(overlap=False)"
        #: whether ``overlap=False`` turned off the overlap of an algorithm that had it on
        self.lowbit_overlap_turned_off = False
        self._lowbit_prepared: list[_Prepared] = []
        self._lowbit_load_dir: str | None = None
        #: the FSDP2 plugin asked for (the sharded form: accelerate_sharded), None for DDP
        self.lowbit_fsdp_plugin = take_fsdp_plugin(accelerator_kwargs, self._who())
        #: unsharded parameter (id) -> its sharded replacement, for optimizers built before prepare
        self._lowbit_remap: dict[int, torch.nn.Parameter] = {}
        self._lowbit_hidden: list[Any] = []  # optimizers of sharded models while Accelerate saves the rest
        # Accelerate itself refuses some precisions only later (or on some devices): check
        # what was asked for first, so the message is the algorithm's, then what was set up.
        asked = accelerator_kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION")
        if asked:
            self._check_precision(str(getattr(asked, "value", asked)))
        if (
            not accelerator_kwargs.get("cpu")
            and not env_flag(os.environ.get("ACCELERATE_USE_CPU"))
            and launched_world_size() > 1
            and not has_device_backend()
        ):
            logger.info(
                "lowbit: %d processes launched on a machine without a GPU: LowBitAccelerator passes "
                "cpu=True so that they form one gloo group (MULTI_CPU) instead of each training alone",
                launched_world_size(),
            )
            accelerator_kwargs["cpu"] = True
        with fsdp_env_off() if self.lowbit_fsdp_plugin is not None else contextlib.nullcontext():
            super().__init__(**accelerator_kwargs)
        if dist.is_available() and dist.is_initialized():
            destroy_process_group_at_exit()
        self._check_precision(str(self.mixed_precision))
        if self.distributed_type.name in _NOT_DDP:
            raise LowBitSetupError(
                f"LowBitAccelerator synchronizes DistributedDataParallel models, but Accelerate is set up for "
                f"{self.distributed_type.name}; use a multi-GPU / multi-CPU config (distributed_type: MULTI_GPU), "
                "or an FSDP config with fsdp_version: 2 (the sharded form), without DeepSpeed, Megatron-LM or XLA"
            )
        self._configure_ddp_kwargs()
        self.register_save_state_pre_hook(self._save_lowbit_states)
        self.register_load_state_pre_hook(self._remember_load_dir)

    @property
    def lowbit_syncs(self) -> list[Sync]:
        """The :class:`Sync` of every prepared DDP model, in the order they were prepared."""
        return [p.sync for p in self._lowbit_prepared]

    # ---- setup --------------------------------------------------------------------
    def _who(self) -> str:
        return f"LowBitAccelerator(algorithm={self.lowbit_config.algorithm!r})"

    def _check_precision(self, mixed_precision: str) -> None:
        self.lowbit_algorithm.check_precision(PRECISIONS.get(mixed_precision.lower(), mixed_precision))

    def _configure_ddp_kwargs(self) -> None:
        """DDP's buckets are the units the hook compresses: their size is the config's
        ``bucket_size_mb`` unless ``DistributedDataParallelKwargs(bucket_cap_mb=...)`` says otherwise."""
        handler = self.ddp_handler
        if handler is not None and handler.comm_hook.value != "no":
            raise LowBitSetupError(
                f"{self._who()} registers the algorithm's own DDP communication hook and a DDP model takes one; "
                f"remove comm_hook={handler.comm_hook.value!r} from DistributedDataParallelKwargs"
            )
        handler = handler if handler is not None else DistributedDataParallelKwargs()
        if "bucket_cap_mb" not in handler.to_kwargs():
            handler = dataclasses.replace(handler, bucket_cap_mb=self.lowbit_config.bucket_size_mb)
        self.ddp_handler = handler

    def prepare_model(self, model: torch.nn.Module, *args: Any, **kwargs: Any):
        """Accelerate's ``prepare_model``; a DDP model also gets the algorithm's :class:`Sync`
        and communication hook (before its first backward). With an FSDP2 plugin, or a model
        already ``fully_shard``-ed: sharded inside each node, no DDP, and
        :func:`~lowbit_strategy.attach_sharded` (:mod:`~lowbit_strategy.integrations.accelerate_sharded`)."""
        if self._wants_sharding(_unwrap_compiled(model)):
            if any(_unwrap_compiled(model) is p.model for p in self._lowbit_prepared):
                return model
            evaluation_only = super().prepare_model  # autocast / compile, never DDP
            return self._prepare_sharded(
                model, lambda m: evaluation_only(m, device_placement=False, evaluation_mode=True)
            )
        prepared = super().prepare_model(model, *args, **kwargs)
        ddp = _unwrap_compiled(prepared)
        if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and not any(
            ddp is p.model for p in self._lowbit_prepared
        ):
            sync = build_sync(self.lowbit_config, ddp, group=None)
            ddp.register_comm_hook(sync.hook_state, sync.comm_hook)
            self._apply_overlap(sync)
            self._lowbit_prepared.append(_Prepared(ddp, sync))
            self._attach_optimizers()
        elif not self.lowbit_syncs and self.num_processes == 1:
            logger.info(
                "lowbit: one process, nothing to synchronize: %s trains as a plain single-process model",
                type(_unwrap_compiled(model)).__name__,
            )
        return prepared

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
        """Accelerate's ``prepare_optimizer``; the optimizer is attached to the algorithm of
        the prepared model whose parameters it holds (an optimizer built on a model's unsharded
        parameters gets the sharded ones)."""
        switch_parameters(_real_optimizer(optimizer), self._lowbit_remap)
        prepared = super().prepare_optimizer(optimizer, *args, **kwargs)
        self._attach_optimizers()
        return prepared

    def _apply_overlap(self, sync: Sync) -> None:
        """``overlap=False``: the algorithm synchronizes at the step, not during backward."""
        if not self.lowbit_overlap:
            self.lowbit_overlap_turned_off |= sync.overlap
            sync.disable_overlap(self.lowbit_overlap_reason)

    def _record_sharded(self, model: torch.nn.Module, sync: Sync, nodes: int) -> None:
        self._apply_overlap(sync)
        self._lowbit_prepared.append(_Prepared(model, sync, nodes=nodes))

    @contextlib.contextmanager
    def no_sync(self, model):
        """Accelerate's ``no_sync`` (so ``accumulate``); for a sharded model FSDP2's gradient sync
        off (Accelerate does that only when it set FSDP2 up itself)."""
        with self._sharded_no_sync(model) as done:
            if done:
                yield
            else:
                with super().no_sync(model):
                    yield

    def _attach_optimizers(self) -> None:
        """Attach every prepared optimizer to the sync of the model whose parameters it holds
        (again whenever that set changes; the same order on every rank)."""
        optimizers = [_real_optimizer(o) for o in self._optimizers]
        for prepared in self._lowbit_prepared:
            owned = {id(p) for p in prepared.model.parameters()}
            mine = [o for o in optimizers if any(id(p) in owned for g in o.param_groups for p in g["params"])]
            if mine and [id(o) for o in mine] != prepared.attached:
                attach_optimizers(prepared.sync, mine, who=self._who())
                prepared.attached = [id(o) for o in mine]

    # ---- gradients changed after backward -------------------------------------------
    def backward(self, loss, **kwargs: Any) -> None:
        if self.gradient_accumulation_steps > 1 and self.gradient_state.plugin_kwargs.get("sync_each_batch"):
            # the hook then runs on every micro-batch, but the update comes once per step
            self._disable_overlap(
                "GradientAccumulationPlugin(sync_each_batch=True) runs the DDP hook on every micro-batch"
            )
        return super().backward(loss, **kwargs)

    def _disable_overlap(self, reason: str) -> None:
        if self.lowbit_overlap:
            self.lowbit_overlap = False
            for sync in self.lowbit_syncs:
                sync.disable_overlap(reason)

    def _refuse_if_overlapping(self, what: str) -> None:
        # Sync.overlap: the algorithm synchronizes during backward; the others (gradient-level
        # ones) have nothing in flight that clipping could miss
        busy = [s for s in self.lowbit_syncs if s.overlap]
        if busy:
            raise LowBitSetupError(
                f"{what} changes the gradients after backward, but {self._who()} already started synchronizing "
                "them during backward (overlap). Create the accelerator with LowBitAccelerator(..., overlap=False) "
                "in scripts that clip or rescale gradients: the update is then formed in optimizer.step() from the "
                "clipped gradients"
            )

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        """Accelerate's ``clip_grad_norm_`` (needs ``LowBitAccelerator(overlap=False)`` with an
        optimizer-level algorithm; it clips each rank's local gradient there). With
        ``max_norm=inf`` it only measures the norm (the Hugging Face ``Trainer`` does so to
        log ``grad_norm``): allowed whatever ``overlap`` is, as no gradient changes."""
        if not math.isinf(float(max_norm)):
            self._refuse_if_overlapping("accelerator.clip_grad_norm_")
        return super().clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters, clip_value):
        """Accelerate's ``clip_grad_value_`` (see :meth:`clip_grad_norm_`)."""
        self._refuse_if_overlapping("accelerator.clip_grad_value_")
        return super().clip_grad_value_(parameters, clip_value)

    def get_state_dict(self, model, unwrap: bool = True):
        """Accelerate's ``get_state_dict`` (so ``save_model``); a sharded model's full weights,
        gathered from the shards onto the main process's CPU, as Accelerate's own FSDP2 path
        does (a collective: call it on every rank)."""
        if is_sharded(_unwrap_compiled(model)):
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_model_state_dict(_unwrap_compiled(model), options=options)
        return super().get_state_dict(model, unwrap=unwrap)

    # ---- telemetry ------------------------------------------------------------------
    def traffic_logs(self) -> list[wire.TrafficLog]:
        """This rank's traffic logs, one or more per prepared model."""
        return [log for sync in self.lowbit_syncs for log in sync.traffic_logs()]

    @property
    def bytes_sent(self) -> int:
        """Bytes this rank has put on the wire so far (every prepared model)."""
        return sum(log.bytes_sent for log in self.traffic_logs())

    def ddp_bytes_per_step(self) -> int:
        """Bytes one rank would send per optimizer step with DDP's fp32 ring allreduce of every
        trainable parameter of the prepared models (0 on one process); for a sharded model,
        HSDP's fp32 all-reduce of this rank's shards across nodes."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        total = 0
        for m in self._lowbit_prepared:
            trainable = [p for p in m.model.parameters() if p.requires_grad]
            if m.nodes:
                local = sum(getattr(p, "to_local", lambda p=p: p)().numel() for p in trainable)
                total += wire.allreduce_bytes(4 * local, m.nodes)
            else:
                total += wire.allreduce_bytes(4 * sum(p.numel() for p in trainable), world)
        return total

    def free_memory(self, *objects: Any):
        """Accelerate's ``free_memory``; the prepared models' algorithms are detached first."""
        for sync in self.lowbit_syncs:
            sync.detach()
        self._lowbit_prepared = []
        return super().free_memory(*objects)


def _real_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer
