"""LowBitStrategy: Lightning's DDPStrategy driving any registered algorithm.

The strategy holds no per-algorithm code: it looks ``config.algorithm`` up in
:data:`lowbit_strategy.algorithms.REGISTRY` and drives the algorithm's
:class:`~lowbit_strategy.algorithms.Sync` (see :mod:`lowbit_strategy.algorithms.base`):

* ``setup``: the algorithm checks the precision; ``configure_ddp`` wraps the model in DDP
  and registers the algorithm's communication hook — Lightning registers hooks only on
  CUDA, ours run on gloo/CPU too; after the optimizers exist, the sync wires them (an
  optimizer it cannot drive is a :class:`LowBitSetupError` naming what to use);
* checkpoints: ``save_checkpoint`` (every rank calls it) gathers every rank's rank-local
  state under ``lowbit_rank_states``, however and whenever it is saved — during ``fit`` or
  with ``trainer.save_checkpoint(path)`` after it; ``load_optimizer_state_dict`` gives each
  rank its own back (another world size: the algorithm's merge, with a warning);
* ``traffic_logs()``: the bytes on the wire, still readable after ``fit``.

Notes for users:

* ``import lowbit_strategy`` before building the ``Trainer``: Lightning resolves strategy
  names from its registry when the ``Trainer`` is built; the import registers ours.
* Optimizer-level algorithms (Lion Cub) keep gradients local: gradient clipping
  (``gradient_clip_val``) clips each rank's *local* gradient, and gradient accumulation
  synchronizes once per real optimizer step.
"""

from __future__ import annotations

import logging
import os
from typing import Any, cast

from lightning.fabric.utilities.optimizer import _optimizer_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.nn.parallel import DistributedDataParallel

from lowbit_strategy import algorithms, rank_state
from lowbit_strategy.algorithms.base import LowBitSetupError, Sync
from lowbit_strategy.collectives.wire import TrafficLog
from lowbit_strategy.config import LowBitConfig
from lowbit_strategy.integrations._factories import config_from, named_factory
from lowbit_strategy.integrations.ddp import attach_optimizers, build_sync, destroy_process_group_at_exit

logger = logging.getLogger(__name__)

__all__ = ["LowBitStrategy", "LowBitSetupError", "VARIANTS", "register_strategies", "strategy_names"]


def unwrap_optimizer(opt):
    return opt._optimizer if isinstance(opt, LightningOptimizer) else opt


def gradients_change_after_backward(trainer, module) -> str:
    """Why ``module``'s gradients may change between backward and ``optimizer.step()`` under
    ``trainer`` (clipping, a clipping override, manual optimization), or '': then an
    optimizer-level algorithm must form what it sends at the step, not during backward."""
    import lightning.pytorch as pl

    if getattr(trainer, "gradient_clip_val", None):
        return f"gradient_clip_val={trainer.gradient_clip_val}"
    if type(module).configure_gradient_clipping is not pl.LightningModule.configure_gradient_clipping:
        return f"{type(module).__name__}.configure_gradient_clipping"
    if not module.automatic_optimization:
        return "manual optimization"
    return ""


class LowBitStrategy(DDPStrategy):
    """DDP with low-bit synchronization driven by a :class:`LowBitConfig`.

    ``LowBitStrategy(config=LowBitConfig(...))``, ``LowBitStrategy(algorithm="lion", bits=4)``,
    ``LowBitStrategy(config="lowbit.yaml")`` or a registered name such as
    ``strategy="lowbit_lion"``. Keyword arguments that :class:`LowBitConfig` accepts
    (shared fields, sections, section fields) override ``config``; the rest go to
    ``DDPStrategy``.
    """

    strategy_name = "lowbit"
    #: the registered name this strategy was made under (set by the registry's factory)
    _lowbit_name: str

    def __init__(self, config: LowBitConfig | dict | str | None = None, **kwargs: Any) -> None:
        hooks = [k for k in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper") if kwargs.get(k) is not None]
        if hooks:
            raise LowBitSetupError(
                f"LowBitStrategy registers its algorithm's own DDP communication hook, and a DDP model takes one; "
                f"remove {', '.join(hooks)} (for a plain DDP hook such as PowerSGD use strategy='ddp')"
            )
        self.lowbit_config = config_from(config, kwargs)
        self.algorithm = algorithms.get(self.lowbit_config.algorithm)
        self.sync: Sync | None = None
        super().__init__(**kwargs)

    def configure_lowbit(self, **overrides: Any) -> None:
        """Change :attr:`lowbit_config` fields before ``fit`` sets the strategy up (e.g. from a
        callback's ``setup``, as ``callbacks.MomentumSync`` does); validated like the
        constructor's. The synchronization is built from the config at every ``fit``."""
        self.lowbit_config = self.lowbit_config.replace(**overrides)

    # ---- wiring ---------------------------------------------------------------------
    def setup_distributed(self) -> None:
        super().setup_distributed()
        # Lightning destroys the process group at exit only for NCCL
        destroy_process_group_at_exit()

    def configure_ddp(self) -> None:
        # DDP's buckets are the units the hook compresses and launches during backward, so
        # their size is the config's ``bucket_size_mb`` (an explicit ``bucket_cap_mb`` wins).
        self._ddp_kwargs.setdefault("bucket_cap_mb", self.lowbit_config.bucket_size_mb)
        # A DDP model accepts one hook: register the algorithm's here, never through super().
        super().configure_ddp()
        module = self.lightning_module
        if module is None:
            raise RuntimeError("LowBitStrategy.configure_ddp: no LightningModule is connected")
        # the devices of one node: Lightning's launcher does not export LOCAL_WORLD_SIZE
        self.sync = build_sync(self.lowbit_config, module, group=None, ranks_per_node=self.num_processes)
        ddp = cast(DistributedDataParallel, self.model)  # DDPStrategy.configure_ddp wrapped the module in DDP
        ddp.register_comm_hook(self.sync.hook_state, self.sync.comm_hook)

    def setup(self, trainer) -> None:
        self.algorithm.check_precision(getattr(self.precision_plugin, "precision", None))
        super().setup(trainer)
        if trainer.state.fn == TrainerFn.FITTING and self.sync is not None:
            attach_optimizers(
                self.sync, [unwrap_optimizer(o) for o in self.optimizers], who=f"strategy {self._registered_name()}"
            )
            reason = self._gradients_change_after_backward(trainer)
            if reason:
                self.sync.disable_overlap(
                    f"{reason} may change the gradients after backward, so the synchronized "
                    "update must be formed in optimizer.step()"
                )

    def _gradients_change_after_backward(self, trainer) -> str:
        """Why gradients may change between backward and ``optimizer.step()``, or ''."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError("LowBitStrategy.setup: no LightningModule is connected")
        return gradients_change_after_backward(trainer, module)

    def _registered_name(self) -> str:
        return f"'{getattr(self, '_lowbit_name', f'LowBitStrategy(algorithm={self.lowbit_config.algorithm!r})')}'"

    def teardown(self) -> None:
        # The optimizers outlive the run as plain single-process optimizers; the sync stays,
        # so its traffic stays readable and a checkpoint saved after fit keeps every rank's
        # state.
        if self.sync is not None:
            self.sync.detach()
        super().teardown()

    # ---- telemetry ------------------------------------------------------------------
    def traffic_logs(self) -> list[TrafficLog]:
        """The traffic logs of the current run (after ``fit`` returns, of the finished one)."""
        return self.sync.traffic_logs() if self.sync is not None else []

    # ---- checkpoints: every rank's own state ----------------------------------------
    def save_checkpoint(self, ckpt: dict[str, Any], filepath, storage_options=None) -> None:
        """Lightning's checkpoint, plus every rank's rank-local state in a file of its own in
        ``<checkpoint>.lowbit/`` (the checkpoint holds their index): no rank holds more than
        its own state, and a failed write on any rank raises on every rank. Remote paths
        (``scheme://``) keep the states inside the checkpoint, gathered on rank 0."""
        # Every rank calls this (Trainer.save_checkpoint), so the collectives are safe here. Only
        # full training checkpoints carry rank-local state, as only they carry optimizer state.
        if self.sync is not None and "optimizer_states" in ckpt:
            state, group = self.sync.state_dict(), self.sync.group
            if _local(filepath):
                entry = rank_state.save_files(state, sidecar_dir(filepath), group)
            else:
                entry = rank_state.gather(state, group)
            if entry is not None:
                ckpt = {**ckpt, rank_state.KEY: {**entry, "algorithm": self.lowbit_config.algorithm}}
        # rank 0 writes Lightning's file: if that fails, every rank raises (else the others wait for
        # it in Trainer.save_checkpoint's barrier until the timeout)
        rank_state.together(
            "save_checkpoint",
            lambda: super(LowBitStrategy, self).save_checkpoint(ckpt, filepath, storage_options=storage_options),
        )

    def remove_checkpoint(self, filepath) -> None:
        """Lightning's removal (rank 0), and this rank's file of the checkpoint's rank-local state."""
        super().remove_checkpoint(filepath)
        if _local(filepath):
            rank_state.remove_files(sidecar_dir(filepath), self.sync.group if self.sync is not None else None)

    def load_checkpoint(self, checkpoint_path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Lightning's load on every rank; a rank that cannot read the checkpoint makes every rank
        raise, naming the ranks (instead of the others waiting for it in the next collective)."""
        self._lowbit_ckpt_path = checkpoint_path  # where the rank-local files are, for the optimizer state
        return rank_state.together(
            "load_checkpoint", lambda: super(LowBitStrategy, self).load_checkpoint(checkpoint_path, *args, **kwargs)
        )

    def load_optimizer_state_dict(self, ckpt) -> None:
        for opt, saved in zip(self.optimizers, ckpt["optimizer_states"]):
            opt.load_state_dict(saved)
            _optimizer_to_device(opt, self.root_device)
        entry = ckpt.get(rank_state.KEY)
        if self.sync is None:
            return
        if entry is None or entry.get("algorithm") != self.lowbit_config.algorithm:
            logger.warning(
                "lowbit: the checkpoint holds no %s rank-local state; every rank starts from rank 0's optimizer state",
                self.lowbit_config.algorithm,
            )
            return
        what = f"{self.lowbit_config.algorithm} rank-local buffers"
        if entry.get("format") == "files":
            path = getattr(self, "_lowbit_ckpt_path", None)
            if path is None:
                raise RuntimeError(
                    "lowbit: the checkpoint's rank-local state is in files beside it, but its path is "
                    "unknown; load it with Trainer(...).fit(ckpt_path=...)"
                )
            sidecar = sidecar_dir(path, resolve=True)
            state = rank_state.load_files(entry, sidecar, self.algorithm.merge_states, what, self.sync.group)
        else:
            state = rank_state.pick(entry, self.global_rank, self.world_size, self.algorithm.merge_states, what)
        self.sync.load_state_dict(state)


def _local(filepath) -> bool:
    return "://" not in str(filepath) or str(filepath).startswith("file://")


def sidecar_dir(filepath, resolve: bool = False) -> str:
    """The directory of a checkpoint's per-rank files: ``<checkpoint>.lowbit``; with ``resolve``
    beside the file a symlinked checkpoint points to (ModelCheckpoint's ``save_last="link"``)."""
    path = str(filepath)
    path = path[len("file://") :] if path.startswith("file://") else path
    return (os.path.realpath(path) if resolve else path) + ".lowbit"


#: launcher suffix -> start method, like Lightning's ``ddp``, ``ddp_spawn``, ``ddp_notebook``
VARIANTS = {"": "popen", "_spawn": "spawn", "_notebook": "fork"}


def strategy_names() -> dict[str, tuple[algorithms.Algorithm, dict[str, Any]]]:
    """Every registered base name (no variant suffix) -> (algorithm, its init arguments)."""
    return {
        name: (algo, dict(kwargs))
        for algo in algorithms.REGISTRY.values()
        for name, kwargs in algo.strategy_names.items()
    }


def register_strategies(registry=StrategyRegistry) -> list[str]:
    """Register every algorithm's names x :data:`VARIANTS` (idempotent: re-registering overrides)."""
    names = []
    for base, (algo, cfg) in strategy_names().items():
        detail = ", ".join(f"{k}={v}" for k, v in cfg.items() if k != "algorithm")
        for suffix, start_method in VARIANTS.items():
            name = base + suffix
            registry.register(
                name,
                named_factory(name, LowBitStrategy),
                description=f"{algo.summary} ({detail}) with start_method '{start_method}'",
                override=True,
                start_method=start_method,
                **cfg,
            )
            names.append(name)
    return names


register_strategies()  # importing this module is what registers the names
