"""LowBitTrainer: the Hugging Face ``Trainer`` (and any subclass of it, TRL's ``SFTTrainer``
included) driving any registered algorithm.

Migrating a ``Trainer`` script is one class name::

    trainer = LowBitTrainer(model=model, args=args, train_dataset=data)   # was: Trainer(...)
    class MySFT(LowBitTrainerMixin, SFTTrainer): ...                       # any Trainer subclass

with ``LOWBIT_CONFIG=lowbit.yaml`` (or ``LOWBIT_<FIELD>`` variables) exported for the launcher,
or ``lowbit=`` (a :class:`LowBitConfig`, a dict or a YAML path) passed to the trainer.

``Trainer`` builds its own ``Accelerator`` and offers no way to hand it another (Accelerate's
``DistributedDataParallelKwargs`` takes only its closed ``comm_hook`` enum). The mixin keeps
``Trainer``'s own code for it and swaps the class it instantiates: inside
:meth:`create_accelerator_and_postprocess`, ``transformers.trainer.Accelerator`` is briefly
:class:`~lowbit_strategy.integrations.accelerate.LowBitAccelerator`, which receives every
argument ``Trainer`` passes (gradient accumulation, dataloader configuration, DDP kwargs,
mixed precision) and does the rest as in any Accelerate script. The mixin holds no
per-algorithm code; the registry entry (:class:`~lowbit_strategy.algorithms.base.Algorithm`)
says which optimizer an algorithm drives.

* **Optimizer.** An optimizer-level algorithm (Lion Cub, 1-bit Adam/LAMB, TurboQuant-Adam)
  gets its optimizer built from ``TrainingArguments`` as ``Trainer`` builds AdamW:
  ``learning_rate``, ``(adam_beta1, adam_beta2)``, ``adam_epsilon`` where the optimizer takes
  them, ``Trainer``'s decay / no-decay parameter groups (``weight_decay`` on the first),
  ``optim_args`` (``"freeze_step=200,variance=local"``) for the rest, and ``Trainer``'s LR
  scheduler on top. Its full-precision warm-up (``freeze_step`` / ``warmup_steps``) defaults
  to 20 % of the training steps. ``TrainingArguments.optim`` is not used for them. A
  gradient-level algorithm (BitDP) keeps whatever optimizer ``Trainer`` builds. An optimizer
  passed in ``optimizers=(opt, scheduler)`` that the algorithm cannot drive is a
  :class:`LowBitSetupError` naming the fix.
* **Clipping.** ``Trainer`` clips gradients by default (``max_grad_norm=1.0``) after backward,
  when an overlapping algorithm has already sent them: the mixin then runs the algorithm with
  step-time synchronization (same result, no overlap with backward) and the algorithm logs it
  once. ``max_grad_norm=0`` keeps the overlap. Optimizer-level algorithms keep gradients
  local, so ``grad_norm`` (logged and clipped) is each rank's local gradient's.
* **Checkpoints.** ``Trainer`` writes the main process's optimizer state; every rank also
  writes its own algorithm state (momenta, error feedback) into the checkpoint folder
  (``lowbit_rank_states/``), and ``train(resume_from_checkpoint=...)`` hands each rank its
  own back: bit for bit at the same world size, the algorithm's merge (with a warning) at
  another. A save or load that fails on one rank raises on every rank.
* **Sharded models.** With the ``Trainer``'s FSDP arguments (``fsdp="full_shard"``,
  ``fsdp_config={"fsdp_version": 2, ...}``) or a model already ``fully_shard``-ed, the model is
  sharded inside each node and the algorithm runs across nodes, on CPUs and GPUs alike
  (:mod:`~lowbit_strategy.integrations.hf_sharded`; the model and optimizer are checkpointed
  through ``torch.distributed.checkpoint``).
* **What users see.** Training logs (and so every ``report_to`` logger) carry
  ``comm/bytes_per_step`` (bytes this rank sent per optimizer step since the last log),
  ``comm/ratio_vs_fp32`` (DDP's fp32 ring allreduce of every trainable gradient over that) and,
  where the host can time the transfers, ``comm/seconds_per_step``; the progress bar shows
  ``comm_MB`` and ``comm_x``.

Tested with transformers 5.23 and TRL 1.16 (``pip install "lowbit-strategy[hf]"``).
"""

from __future__ import annotations

import ast
import inspect
import logging
import math
import os
import threading
from collections.abc import Mapping
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_callback import ProgressCallback

from lowbit_strategy import algorithms
from lowbit_strategy.algorithms.base import LowBitSetupError
from lowbit_strategy.config import LowBitConfig
from lowbit_strategy.integrations.accelerate import LowBitAccelerator
from lowbit_strategy.integrations.accelerate_launch import env_flag, has_device_backend, launched_world_size
from lowbit_strategy.integrations.hf_sharded import ShardedTrainerCheckpoints

logger = logging.getLogger(__name__)

__all__ = [
    "CommMeter",
    "LowBitSetupError",
    "LowBitTrainer",
    "LowBitTrainerMixin",
    "WARMUP_FRACTION",
    "parse_optim_args",
]

#: an optimizer-level algorithm's full-precision warm-up, as a share of the training steps,
#: when ``optim_args`` does not set it (1-bit Adam's paper: 15-25 % of BERT's steps)
WARMUP_FRACTION = 0.2

# transformers.trainer.Accelerator is swapped for the duration of one Trainer's set-up
_SWAP_LOCK = threading.Lock()


class CommMeter:
    """Bytes this rank put on the wire per optimizer step, from the running totals of the
    accelerator's traffic logs (O(1) per read, however long the run)."""

    def __init__(self, accelerator: LowBitAccelerator) -> None:
        self.accelerator = accelerator
        self.ddp_bytes_per_step = accelerator.ddp_bytes_per_step()
        self._start = self._last_step = self._last_log = self._now(0)

    def _now(self, step: int) -> tuple[int, int, float | None]:
        logs = self.accelerator.traffic_logs()
        seconds = [log.seconds for log in logs]
        total = None if any(s is None for s in seconds) else float(sum(s for s in seconds if s is not None))
        return step, sum(log.bytes_sent for log in logs), total

    def start(self, step: int) -> None:
        """Training (re)starts at optimizer step ``step``."""
        self.ddp_bytes_per_step = self.accelerator.ddp_bytes_per_step()
        self._start = self._last_step = self._last_log = self._now(step)

    def _per_step(self, before: tuple[int, int, float | None], now: tuple[int, int, float | None]) -> dict[str, float]:
        steps = max(now[0] - before[0], 1)
        sent = (now[1] - before[1]) / steps
        # one process: nothing to send either way, so 1x (not 0x) against fp32
        ratio = self.ddp_bytes_per_step / sent if sent else (1.0 if self.ddp_bytes_per_step == 0 else 0.0)
        out = {"comm/bytes_per_step": float(sent), "comm/ratio_vs_fp32": float(ratio)}
        if now[2] is not None and before[2] is not None:  # (CUDA: unavailable, not a wrong 0)
            out["comm/seconds_per_step"] = (now[2] - before[2]) / steps
        return out

    def step(self, step: int) -> dict[str, float]:
        """The last optimizer step's figures (for the progress bar)."""
        now = self._now(step)
        out = self._per_step(self._last_step, now)
        self._last_step = now
        return out

    def since_last_log(self, step: int) -> dict[str, float]:
        """Per-step averages since the previous call (for a training log)."""
        now = self._now(step)
        out = self._per_step(self._last_log, now)
        self._last_log = now
        return out

    def summary(self, step: int) -> dict[str, float]:
        """Per-step averages and the total since training (re)started."""
        now = self._now(step)
        return {**self._per_step(self._start, now), "comm/total_bytes": float(now[1] - self._start[1])}


class _CommProgress(TrainerCallback):
    """Starts the meter with training and puts the last step's bytes in ``Trainer``'s progress bar."""

    def __init__(self, trainer: LowBitTrainerMixin) -> None:
        self.trainer = trainer
        self.warned = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.lowbit_meter.start(state.global_step)
        accelerator = self.trainer.accelerator
        if accelerator.lowbit_overlap_turned_off and not self.warned and state.is_world_process_zero:
            self.warned = True
            logger.warning(
                "lowbit: %s synchronizes in optimizer.step(), not during backward: %s",
                self.trainer.lowbit_config.algorithm,
                accelerator.lowbit_overlap_reason,
            )

    def on_step_end(self, args, state, control, **kwargs):
        figures = self.trainer.lowbit_meter.step(state.global_step)
        for callback in self.trainer.callback_handler.callbacks:
            bar = getattr(callback, "training_bar", None) if isinstance(callback, ProgressCallback) else None
            if bar is not None:
                bar.set_postfix(
                    comm_MB=f"{figures['comm/bytes_per_step'] / 2**20:.3g}",
                    comm_x=f"{figures['comm/ratio_vs_fp32']:.3g}",
                    refresh=False,
                )


class LowBitTrainerMixin(ShardedTrainerCheckpoints):
    """Put before a ``Trainer`` class (``class MySFT(LowBitTrainerMixin, SFTTrainer)``) to run
    it with the configured low-bit algorithm.

    Args:
        lowbit: a :class:`LowBitConfig`, a dict of its fields or a YAML path. None reads the
            environment the launcher passes on: ``LOWBIT_CONFIG`` (a YAML path) and
            ``LOWBIT_<FIELD>`` / ``LOWBIT_<SECTION>_<FIELD>`` overrides.
        *args, **kwargs: everything the ``Trainer`` class takes.
    """

    # provided by Trainer
    args: Any
    accelerator: Any
    optimizer: Any
    state: Any
    callback_handler: Any

    def __init__(
        self, *args: Any, lowbit: LowBitConfig | Mapping[str, Any] | str | os.PathLike | None = None, **kwargs
    ):
        self.lowbit_config = LowBitConfig.from_env() if lowbit is None else LowBitConfig.coerce(lowbit)
        self.lowbit_algorithm = algorithms.get(self.lowbit_config.algorithm)
        self._lowbit_total_steps = 0
        _check_processes_train_together(args[1] if len(args) > 1 else kwargs.get("args"))
        super().__init__(*args, **kwargs)
        self.lowbit_meter = CommMeter(self.accelerator)
        self.add_callback(_CommProgress(self))  # type: ignore[attr-defined]

    def _who(self) -> str:
        return f"{type(self).__name__}(algorithm={self.lowbit_config.algorithm!r})"

    # ---- the accelerator --------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        """``Trainer``'s own set-up, with :class:`LowBitAccelerator` in place of ``Accelerator``."""
        import transformers.trainer as hf_trainer

        clip = self.args.max_grad_norm
        overlap = not (clip is not None and clip > 0)

        def build(**accelerator_kwargs: Any) -> LowBitAccelerator:
            accelerator = LowBitAccelerator(self.lowbit_config, overlap=overlap, **accelerator_kwargs)
            accelerator.lowbit_overlap_reason = (
                f"TrainingArguments.max_grad_norm={clip} clips gradients after backward "
                "(max_grad_norm=0 keeps communication overlapped with backward)"
            )
            return accelerator

        with _SWAP_LOCK:
            original = getattr(hf_trainer, "Accelerator", None)
            if original is None:
                raise LowBitSetupError(_unsupported("transformers.trainer has no Accelerator"))
            hf_trainer.Accelerator = build
            try:
                super().create_accelerator_and_postprocess()  # type: ignore[misc]
            finally:
                hf_trainer.Accelerator = original
        if not isinstance(self.accelerator, LowBitAccelerator):
            raise LowBitSetupError(
                _unsupported("Trainer did not build its accelerator in create_accelerator_and_postprocess")
            )

    # ---- the optimizer ------------------------------------------------------------------
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self._lowbit_total_steps = int(num_training_steps)
        super().create_optimizer_and_scheduler(num_training_steps)  # type: ignore[misc]

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The algorithm's optimizer from ``TrainingArguments`` (optimizer-level algorithms), or
        ``Trainer``'s own (gradient-level ones); see the module docstring."""
        cls = self.lowbit_algorithm.optimizer
        given = getattr(self, "optimizer_cls_and_kwargs", None)
        if self.optimizer is not None or cls is None or (given is not None and given[0] is cls):
            optimizer = super().create_optimizer(model)  # type: ignore[misc]  # keeps a given one
            self._check_drivable(optimizer)
            return optimizer
        if given is not None:
            raise LowBitSetupError(
                f"{self._who()} drives {_name(cls)}, but optimizer_cls_and_kwargs names {_name(given[0])}: "
                f"pass {cls.__name__} there, drop optimizer_cls_and_kwargs (the trainer then builds "
                f"{cls.__name__} from TrainingArguments), or use algorithm 'bitdp', which keeps any optimizer"
            )
        module = self.model if model is None else model
        kwargs = self._optimizer_kwargs(cls)
        self.optimizer = cls(self._parameter_groups(module), **kwargs)
        logger.info(
            "lowbit: %s builds %s(%s) from TrainingArguments (optim=%r is not used: algorithm %r drives its own "
            "optimizer)",
            type(self).__name__,
            _name(cls),
            ", ".join(f"{k}={v!r}" for k, v in kwargs.items()),
            str(getattr(self.args.optim, "value", self.args.optim)),
            self.lowbit_config.algorithm,
        )
        return self.optimizer

    def _check_drivable(self, optimizer: torch.optim.Optimizer) -> None:
        cls = self.lowbit_algorithm.optimizer
        if cls is not None and type(optimizer) is not cls:
            raise LowBitSetupError(
                f"{self._who()} drives {_name(cls)}, but the trainer was given {_name(type(optimizer))}. "
                f"Drop optimizers=(...) / optim (the trainer builds {cls.__name__} from TrainingArguments: "
                f"learning_rate, adam_beta1/adam_beta2, weight_decay, optim_args), pass a {cls.__name__}, or use "
                "algorithm 'bitdp', which keeps any optimizer"
            )

    def _parameter_groups(self, module: torch.nn.Module) -> list[dict[str, Any]]:
        """``Trainer``'s decay / no-decay groups (its ``get_decay_parameter_names``), empty ones left out."""
        decay = set(self.get_decay_parameter_names(module))  # type: ignore[attr-defined]
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ]
        return [g for g in groups if g["params"]]

    def _optimizer_kwargs(self, cls: type) -> dict[str, Any]:
        args = self.args
        accepted = set(inspect.signature(cls).parameters) - {"self", "params"}
        candidates = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
        kwargs: dict[str, Any] = {k: v for k, v in candidates.items() if k in accepted}
        extra = parse_optim_args(args.optim_args)
        unknown = sorted(set(extra) - accepted)
        if unknown:
            raise ValueError(
                f"TrainingArguments.optim_args: got {args.optim_args!r}; {_name(cls)} takes no {unknown}. "
                f"Its keyword arguments: {', '.join(sorted(accepted))}"
            )
        warmup = self.lowbit_algorithm.warmup_argument
        steps = self._lowbit_total_steps or getattr(self.state, "max_steps", 0) or max(args.max_steps, 0)
        if warmup is not None and warmup not in extra and steps > 0:
            kwargs[warmup] = max(1, math.floor(WARMUP_FRACTION * steps))
        kwargs.update(extra)
        return kwargs

    # ---- logs -------------------------------------------------------------------------
    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """``Trainer``'s ``log`` with the bytes on the wire added to training logs (per step
        since the last log, and ``*_avg`` since training began) with the algorithm's own figures
        (:meth:`~lowbit_strategy.algorithms.base.Sync.metrics`), and to the end-of-training
        summary (since training began)."""
        step = int(getattr(self.state, "global_step", 0))
        if "train_runtime" in logs:
            logs.update(self.lowbit_meter.summary(step))
        elif "loss" in logs and not any(k.startswith(("eval_", "test_")) for k in logs):
            logs.update(self.lowbit_meter.since_last_log(step))
            since_start = self.lowbit_meter.summary(step)  # amortized (DiLoCo sends every H steps)
            logs["comm/bytes_per_step_avg"] = since_start["comm/bytes_per_step"]
            logs["comm/ratio_vs_fp32_avg"] = since_start["comm/ratio_vs_fp32"]
            for sync in self.accelerator.lowbit_syncs:  # the algorithm's own figures (DiLoCo's rounds, ...)
                logs.update(sync.metrics())
        super().log(logs, *args, **kwargs)  # type: ignore[misc]


class LowBitTrainer(LowBitTrainerMixin, Trainer):
    """``transformers.Trainer`` with the configured low-bit algorithm
    (:class:`LowBitTrainerMixin`; ``lowbit=`` or ``LOWBIT_CONFIG`` / ``LOWBIT_*``)."""


def _check_processes_train_together(training_args: Any) -> None:
    """Several launched processes on a machine without a GPU form one gloo group only with
    ``TrainingArguments(use_cpu=True)``; otherwise each trains alone, silently."""
    if training_args is None or launched_world_size() <= 1 or has_device_backend():
        return
    if getattr(training_args, "use_cpu", False) or env_flag(os.environ.get("ACCELERATE_USE_CPU")):
        return
    raise LowBitSetupError(
        f"{launched_world_size()} processes were launched on a machine without a GPU, but "
        "TrainingArguments(use_cpu=False) makes each of them train alone (Accelerate's DistributedType.NO): "
        "pass TrainingArguments(..., use_cpu=True) (or export ACCELERATE_USE_CPU=1) so that they form one gloo group"
    )


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """``TrainingArguments.optim_args`` (``"freeze_step=200,variance=local"``) as keyword
    arguments: Python literals (numbers, ``True``/``False``, ``None``) where they parse, else strings."""
    out: dict[str, Any] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                f"TrainingArguments.optim_args: got {text!r}; comma-separated key=value pairs, e.g. "
                "'freeze_step=200,variance=local'"
            )
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def _name(cls: type) -> str:
    module = cls.__module__
    return f"lowbit_strategy.{cls.__name__}" if module.startswith("lowbit_strategy") else f"{module}.{cls.__qualname__}"


def _unsupported(what: str) -> str:
    import transformers

    return (
        f"LowBitTrainerMixin cannot put its accelerator into this transformers version ({transformers.__version__}): "
        f"{what}. It is tested with transformers 5.23; please report the version"
    )
