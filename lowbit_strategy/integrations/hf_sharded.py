"""The sharded form of :class:`~lowbit_strategy.integrations.hf.LowBitTrainerMixin`: FSDP2
inside each node, the algorithm's low-bit exchange across nodes, from the ``Trainer``'s FSDP
arguments (``TrainingArguments(fsdp="full_shard", fsdp_config={"fsdp_version": 2, ...})``) or a model
already ``fully_shard``-ed.

The ``Trainer`` hands its FSDP plugin to the accelerator it builds, which is
:class:`~lowbit_strategy.integrations.accelerate.LowBitAccelerator` under the mixin: the
accelerator takes the plugin, Accelerate sets up a plain multi-process run (on CPUs and GPUs
alike: Accelerate enables FSDP on GPUs only) and the model is sharded inside each node at
``prepare`` (:mod:`~lowbit_strategy.integrations.accelerate_sharded`). The ``Trainer`` so sees no
FSDP (``is_fsdp_enabled`` is False) and would save a sharded model and its optimizer as a
replicated one; :class:`ShardedTrainerCheckpoints` writes them instead:

* ``save_model``: the full weights, gathered on every rank (a collective), written by the main
  process as ``Trainer`` writes any model (``save_pretrained``), so a checkpoint folder loads
  with ``from_pretrained`` as usual;
* optimizer: the sharded model and its optimizer through ``torch.distributed.checkpoint``
  (``sharded_model_0/``, each rank its shards) instead of ``optimizer.pt``; the scheduler as
  ``Trainer`` writes it; every rank's low-bit state as for DDP;
* ``resume_from_checkpoint``: the model's weights and the optimizer from ``sharded_model_0/``
  after ``prepare``, then each rank's low-bit state: bit for bit;
* device placement: the ``Trainer`` does not move a sharded model (or one its FSDP arguments
  will shard) to the device whole; ``fully_shard`` places each rank's shards.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lowbit_strategy import rank_state
from lowbit_strategy.integrations.accelerate_sharded import is_sharded

#: ``Trainer``'s scheduler file in a checkpoint folder (transformers.trainer.SCHEDULER_NAME)
SCHEDULER_NAME = "scheduler.pt"


class ShardedTrainerCheckpoints:
    """Checkpoints and device placement of a ``Trainer`` whose model is sharded (module
    docstring); for a replicated model every method is ``Trainer``'s own."""

    # provided by Trainer and LowBitTrainerMixin
    args: Any
    accelerator: Any
    model: Any
    lr_scheduler: Any

    def _lowbit_sharded(self) -> bool:
        return getattr(self.accelerator, "lowbit_fsdp_plugin", None) is not None or is_sharded(self.model)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer``'s ``save_model``; a sharded model's full weights are gathered on every rank
        first (call it on every rank, as ``Trainer`` does), then written by the main process."""
        if not is_sharded(self.model):
            return super().save_model(output_dir, _internal_call)  # type: ignore[misc]
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)  # collective; the tensors on rank 0
        save = self._save  # type: ignore[attr-defined]
        rank_state.together("save_model", lambda: save(output_dir or self.args.output_dir, state_dict=state))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Sharded: the scheduler as ``Trainer`` writes it, the model and optimizer through DCP
        and every rank's low-bit state (``save_lowbit_state``); else ``Trainer``'s own and the
        low-bit state. A failure on any rank raises on every rank."""
        if not self._lowbit_sharded():
            save = super()._save_optimizer_and_scheduler  # type: ignore[misc]
            rank_state.together("saving the optimizer and scheduler", lambda: save(output_dir))
        elif self.args.should_save:
            path = os.path.join(output_dir, SCHEDULER_NAME)
            rank_state.together("saving the scheduler", lambda: torch.save(self.lr_scheduler.state_dict(), path))
        else:
            rank_state.together("saving the scheduler", lambda: None)
        self.accelerator.save_lowbit_state(output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Sharded: the scheduler, then the model, the optimizer and each rank's low-bit state
        (``load_lowbit_state``); else ``Trainer``'s own, then each rank's low-bit state."""
        if checkpoint is None:
            return
        if not self._lowbit_sharded():
            load = super()._load_optimizer_and_scheduler  # type: ignore[misc]
            rank_state.together("loading the optimizer and scheduler", lambda: load(checkpoint))
        else:
            path = os.path.join(checkpoint, SCHEDULER_NAME)
            rank_state.together(
                "loading the scheduler",
                lambda: self.lr_scheduler.load_state_dict(torch.load(path, map_location="cpu", weights_only=True)),
            )
        self.accelerator.load_lowbit_state(checkpoint)

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        """``Trainer`` puts a model it does not see as FSDP on the device whole; not one that is
        or will be sharded: ``fully_shard`` puts each rank's shards on the mesh's device (a whole
        replica on every GPU first is what sharding avoids, and ``.to()`` on FSDP2 parameters
        raises)."""
        if is_sharded(model) or getattr(self.args, "fsdp", None):
            return
        super()._move_model_to_device(model, device)  # type: ignore[misc]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """``Trainer``'s weight loading, for a model not sharded yet (sharded at ``prepare``
        afterwards); a model sharded already gets its weights with the optimizer, from DCP."""
        if is_sharded(model if model is not None else self.model):
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
