"""LowBitStrategy: Lightning's DDPStrategy with low-bit synchronization.

Two places to synchronize (DESIGN.md):

* gradient level, ``algorithm="bitdp"``: the BitDP communication hook
  (:mod:`lowbit_strategy.hooks`) averages gradients in 1 or 2 bits; any optimizer works;
* optimizer level, ``algorithm="lion"``: gradients stay local and Lion Cub synchronizes
  its update vectors in ``step()``.

Optimizer-level algorithms (Lion Cub) need gradients to stay local: the model is still
wrapped in DDP (its forward hooks, unused-parameter handling and launchers), but with a
communication hook that hands every bucket back untouched, so no gradient byte crosses the
wire. After the optimizers are set up, a communicator is attached to each of them and the
optimizer's ``step()`` synchronizes through the compressed collectives.

Notes for users:

* ``import lowbit_strategy`` before building the ``Trainer``: Lightning resolves strategy
  names from its registry when the ``Trainer`` is built, and this import fills it.
* Gradient clipping (``gradient_clip_val``) clips each rank's *local* gradient, before the
  update vector is formed: gradients are never averaged in this mode.
* Gradient accumulation works: the optimizer synchronizes once per real optimizer step.
* ``precision="16-mixed"`` is refused: the GradScaler's found-inf decision is taken per rank
  on local gradients, so one rank could skip a step whose collective the others enter.
  Use ``"bf16-mixed"`` or ``"32-true"`` (Lion's own step skips non-finite gradients on all
  ranks together).
* Checkpoints keep every rank's momentum (see :mod:`lowbit_strategy.checkpoint`).
"""
from __future__ import annotations

import atexit
import logging
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.fabric.utilities.optimizer import _optimizer_to_device

from lowbit_strategy import checkpoint
from lowbit_strategy.collectives import wire
from lowbit_strategy.config import LowBitConfig
from lowbit_strategy.hooks import BitDPState, bitdp_hook
from lowbit_strategy.layers import select_params
from lowbit_strategy.optim import Lion, LionCommunicator

log = logging.getLogger(__name__)


def keep_local_gradients(state, bucket):
    """DDP communication hook that sends nothing: each rank keeps its own gradient.

    (Unannotated on purpose: DDP checks a hook's annotations against the real classes, and
    this module's postponed annotations would be strings.)
    """
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class LowBitSetupError(RuntimeError):
    """A combination the low-bit strategy cannot run, found at setup."""


def _unwrap(opt):
    return opt._optimizer if isinstance(opt, LightningOptimizer) else opt


def _destroy_process_group() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class LowBitStrategy(DDPStrategy):
    """DDP with low-bit synchronization driven by a :class:`LowBitConfig`.

    ``LowBitStrategy(config=LowBitConfig(...))``, ``LowBitStrategy(algorithm="lion", bits=4)``
    or a registered name such as ``strategy="lowbit_lion"``. Keyword arguments that are
    :class:`LowBitConfig` fields override ``config``; the rest go to ``DDPStrategy``.
    """

    strategy_name = "lowbit"

    def __init__(self, config: LowBitConfig | dict | str | None = None, **kwargs: Any) -> None:
        fields = set(LowBitConfig.field_names())
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in fields}
        self.lowbit_config = LowBitConfig.coerce(config, **overrides)
        if self.lowbit_config.algorithm not in ("lion", "bitdp"):
            raise LowBitSetupError(
                f"LowBitStrategy: algorithm={self.lowbit_config.algorithm!r} is not available in this "
                "strategy yet; use algorithm='lion' or 'bitdp'"
            )
        self.bitdp_state: BitDPState | None = None
        super().__init__(**kwargs)

    @property
    def gradient_level(self) -> bool:
        """Whether gradients are synchronized by a DDP hook (BitDP) rather than the optimizer."""
        return self.lowbit_config.algorithm == "bitdp"

    # ---- wiring ---------------------------------------------------------------------
    def setup_distributed(self) -> None:
        super().setup_distributed()
        # Lightning destroys the process group at exit only for NCCL. A gloo group left to
        # interpreter finalization sometimes aborts a *_spawn worker after training
        # ("terminate called without an active exception", ~1 run in 10 here), which the
        # launcher reports as a failed fit. Destroy it while Python is still whole.
        atexit.unregister(_destroy_process_group)  # once, however many fits this process runs
        atexit.register(_destroy_process_group)

    def configure_ddp(self) -> None:
        # Lightning registers comm hooks only on CUDA; ours must run on gloo/CPU as well,
        # and a DDP model accepts one hook, so register it here and never through super().
        super().configure_ddp()
        if self.gradient_level:
            cfg = self.lowbit_config
            self.bitdp_state = BitDPState(
                bits=cfg.bits or 2, quantize=cfg.bitdp_quantize, exclude=cfg.bitdp_exclude,
                start_iter=max(2, cfg.warmup_steps), reduction=cfg.bitdp_reduction,
                error_feedback=cfg.bitdp_error_feedback, log=wire.TrafficLog(),
            ).attach(self.lightning_module)
            self.model.register_comm_hook(self.bitdp_state, bitdp_hook)
        else:
            self.model.register_comm_hook(None, keep_local_gradients)

    def setup(self, trainer) -> None:
        precision = getattr(self.precision_plugin, "precision", None)
        if precision == "16-mixed" and not self.gradient_level:
            raise LowBitSetupError(
                "LowBitStrategy does not support precision='16-mixed': gradients stay local, so each "
                "rank's GradScaler could skip a different step and the ranks would hang. Use "
                "precision='bf16-mixed' or '32-true'."
            )
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and not self.gradient_level:
            self._attach_communicators()

    def _attach_communicators(self) -> None:
        cfg = self.lowbit_config
        module = self.lightning_module
        for opt in map(_unwrap, self.optimizers):
            if not isinstance(opt, Lion):
                raise LowBitSetupError(
                    f"strategy {self._registered_name()} drives lowbit_strategy.Lion, but "
                    f"configure_optimizers returned {type(opt).__module__}.{type(opt).__name__}. Return "
                    "lowbit_strategy.Lion(...) instead, or use strategy='lowbit_bitdp' / 'ddp' for "
                    "other optimizers (their gradients would otherwise never be synchronized)."
                )
            opt.attach_communicator(LionCommunicator(cfg, group=None))
            if cfg.momentum_sync_every:
                opt.set_momentum_sync(cfg.momentum_sync_every, select_params(module, cfg.momentum_sync_layers))

    def _registered_name(self) -> str:
        return f"'{getattr(self, '_lowbit_name', 'lowbit_lion')}'"

    def teardown(self) -> None:
        # The optimizers outlive the run (plain Lion again); their traffic stays readable.
        self._finished_logs = self.traffic_logs()
        for opt in map(_unwrap, self.optimizers):
            if isinstance(opt, Lion):
                opt.attach_communicator(None)
        super().teardown()

    # ---- telemetry ------------------------------------------------------------------
    def traffic_logs(self) -> list[wire.TrafficLog]:
        """The traffic logs of the BitDP hook or of every attached communicator; after
        ``fit`` returns, those of the finished run."""
        out = [self.bitdp_state.log] if self.bitdp_state is not None else []
        comms = [getattr(opt, "communicator", None) for opt in map(_unwrap, self.optimizers)]
        out += [c.log for c in comms if c is not None]
        return out or list(getattr(self, "_finished_logs", []))

    # ---- checkpoints: every rank's own momentum and BitDP state --------------------
    def optimizer_state(self, optimizer) -> dict[str, Any]:
        opt = _unwrap(optimizer)
        if getattr(opt, "communicator", None) is None:
            return super().optimizer_state(optimizer)
        return checkpoint.gather_state_dict(opt)

    def save_checkpoint(self, ckpt: dict[str, Any], filepath, storage_options=None) -> None:
        # Every rank calls this (Trainer.save_checkpoint), so the gather is safe here; only
        # full training checkpoints carry the hook's state, as they carry optimizer state.
        if self.bitdp_state is not None and "optimizer_states" in ckpt:
            ranks = checkpoint.gather_rank_objects(self.bitdp_state.state_dict())
            if ranks is not None:
                ckpt = {**ckpt, checkpoint.BITDP_KEY: ranks}
        super().save_checkpoint(ckpt, filepath, storage_options=storage_options)

    def load_optimizer_state_dict(self, ckpt) -> None:
        for opt, saved in zip(self.optimizers, ckpt["optimizer_states"]):
            opt.load_state_dict(checkpoint.local_state_dict(saved, self.global_rank, self.world_size))
            _optimizer_to_device(opt, self.root_device)
        saved = ckpt.get(checkpoint.BITDP_KEY)
        if self.bitdp_state is not None and saved is not None:
            self.bitdp_state.load_state_dict(checkpoint.pick_rank_state(
                saved, self.global_rank, self.world_size, checkpoint.mean_bitdp_states, "BitDP residuals"))


#: registered name -> config of the Lion Cub family
LION_NAMES: dict[str, dict[str, Any]] = {
    "lowbit_lion": dict(mode="auto"),
    "lowbit_lion_1bit": dict(mode="1bit"),
    "lowbit_lion_4bit": dict(mode="sign", bits=4),
    "lowbit_lion_8bit": dict(mode="lp", bits=8, p=1.0),
    "lowbit_lion_fp32": dict(mode="fp32"),
}
#: registered name -> config of the BitDP family (gradient hook, any optimizer)
BITDP_NAMES: dict[str, dict[str, Any]] = {
    "lowbit_bitdp": dict(algorithm="bitdp", bits=2),
    "lowbit_bitdp_1bit": dict(algorithm="bitdp", bits=1),
}
VARIANTS = {"": "popen", "_spawn": "spawn", "_notebook": "fork"}


def register_strategies(registry=StrategyRegistry) -> list[str]:
    """Register every name of :data:`LION_NAMES` and :data:`BITDP_NAMES` x :data:`VARIANTS`
    (idempotent: re-registering overrides)."""
    names = []
    families = [(n, c, f"Lion Cub ({c['mode']})") for n, c in LION_NAMES.items()]
    families += [(n, c, f"BitDP {c['bits']}-bit gradients") for n, c in BITDP_NAMES.items()]
    for base, cfg, what in families:
        for suffix, start_method in VARIANTS.items():
            name = base + suffix
            registry.register(
                name,
                _named_factory(name),
                description=f"{what} with start_method '{start_method}'",
                override=True,
                start_method=start_method,
                **cfg,
            )
            names.append(name)
    return names


def _named_factory(name: str):
    def make(**kwargs: Any) -> LowBitStrategy:
        strategy = LowBitStrategy(**kwargs)
        strategy._lowbit_name = name
        return strategy

    make.__name__ = f"LowBitStrategy[{name}]"
    return make
