"""LowBitFSDPStrategy: Lightning with FSDP2 inside each node and the low-bit exchange across nodes.

The Lightning front end of :func:`lowbit_strategy.attach_sharded` (the hierarchical form with
the node's stages done by FSDP2: :mod:`lowbit_strategy.integrations.sharded`). Built on
Lightning's ``ModelParallelStrategy``, the strategy of FSDP2 (``fully_shard``, DTensor
parameters): Lightning's ``FSDPStrategy`` is FSDP1 (flat parameters in a wrapper), which has
no per-unit all-reduce hook and which ``attach_sharded`` refuses. From its base it keeps the
launcher, ``configure_model`` with ``self.device_mesh``, meta-device initialization,
precision handling and the distributed (DCP) checkpoints. It holds no per-algorithm code:

* ``setup_environment``: the mesh is :func:`lowbit_strategy.sharding_mesh`'s ``("replicate",
  "shard")`` = ``num_nodes x devices`` (``1 x world`` with ``fsdp_shard="world"``;
  ``self.device_mesh`` in ``configure_model``);
* ``setup``: a LightningModule that shards nothing itself is sharded over
  ``mesh["shard"]``: its repeated blocks (:func:`repeated_blocks`), then a parameterless root
  holding it (:class:`_Root`), through which Lightning runs every step (so FSDP's root hooks
  run whatever module the step calls). One that calls ``fully_shard`` in ``configure_model``
  is left as it is. Then ``attach_sharded`` once the optimizers exist (an optimizer the
  algorithm cannot drive, or an algorithm with no sharded form yet, is a
  :class:`LowBitSetupError` naming the fix);
* gradient accumulation: FSDP's gradient sync is off on the non-final micro-batches
  (``block_backward_sync``; Lightning PyTorch only knows DDP's ``no_sync``), so the node
  reduce-scatter and the exchange across nodes run once per optimizer step;
* ``traffic_logs()``: the bytes across nodes, as :class:`~lowbit_strategy.LowBitStrategy`'s
  (the ``CommStats`` callback shows them in the progress bar);
* checkpoints: the base's (a DCP directory, or one file with ``save_distributed_checkpoint=
  False``), plus every rank's ``sync.state_dict()`` (Lion Cub's momenta, the error buffers:
  they differ across nodes, and DCP keeps one replica of each shard) in a file per rank,
  in ``<checkpoint>/lowbit/`` (beside a single file: ``<checkpoint>.lowbit/``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from lightning.fabric.strategies.model_parallel import _is_sharded_checkpoint
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from lowbit_strategy import algorithms, rank_state
from lowbit_strategy.algorithms.base import LowBitSetupError, Sync
from lowbit_strategy.collectives.wire import TrafficLog
from lowbit_strategy.config import LowBitConfig
from lowbit_strategy.integrations import lightning as _lightning
from lowbit_strategy.integrations._factories import config_from, named_factory
from lowbit_strategy.integrations.ddp import destroy_process_group_at_exit
from lowbit_strategy.integrations.sharded import attach_sharded, fsdp_module_class, sharding_mesh

# ``_lightning``: its module, not its names, as the registration (lowbit_strategy.__init__) may
# import this module while lightning.py itself is still loading (when it is what loaded Lightning)
logger = logging.getLogger(__name__)

__all__ = ["SUFFIX", "LowBitFSDPStrategy", "register_sharded_strategies", "repeated_blocks", "sharded_strategy_names"]

#: appended to an algorithm's primary strategy name: ``lowbit_lion`` -> ``lowbit_lion_fsdp``
SUFFIX = "_fsdp"
#: modules that only hold others (``ModuleList``/``ModuleDict`` have no forward, so no FSDP hook would run)
_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)


class _Root(nn.Module):
    """The FSDP root of an auto-sharded LightningModule: holds it as ``module``, owns no
    parameter. ``self.model`` is this wrapper, so Lightning calls ``training_step`` &c.
    through its forward (its forward redirection, as for DDP): FSDP's root hooks unshard the
    LightningModule's own parameters before every step and reduce their gradients after
    backward, whether the step calls ``self(x)``, ``self.model(x)`` or single layers."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def repeated_blocks(module: nn.Module, classes: tuple[type, ...] | None = None) -> list[nn.Module]:
    """The modules of ``module`` to shard as units before its root, in module order: the
    outermost instances of ``classes`` (default: every class of which ``module`` holds >= 2
    instances with parameters, e.g. transformer blocks) that have parameters. Never
    ``module`` itself, a container (``Sequential``, ``ModuleList``, ...: searched inside), or a
    module sharing a parameter with a module outside it (a tied head stays with the root:
    a unit must own its parameters)."""
    holders = [m for m in module.modules() if m is not module and not isinstance(m, _CONTAINERS)]
    counts = Counter(type(m) for m in holders if next(m.parameters(), None) is not None)
    owners: dict[int, list[int]] = {}  # parameter -> the modules holding it directly
    for m in module.modules():
        for p in m._parameters.values():
            if p is not None:
                owners.setdefault(id(p), []).append(id(m))

    def wanted(m: nn.Module) -> bool:
        if isinstance(m, _CONTAINERS) or next(m.parameters(), None) is None:
            return False
        if not (isinstance(m, classes) if classes is not None else counts[type(m)] >= 2):
            return False
        inside = {id(sub) for sub in m.modules()}
        return all(o in inside for p in m.parameters() for o in owners[id(p)])

    found: list[nn.Module] = []

    def walk(m: nn.Module) -> None:
        for child in m.children():
            if wanted(child):
                found.append(child)
            else:
                walk(child)

    walk(module)
    return found


class LowBitFSDPStrategy(ModelParallelStrategy):
    """FSDP2 inside each node, ``config.algorithm``'s low-bit exchange across nodes.

    ``LowBitFSDPStrategy(config=LowBitConfig(...))``, ``LowBitFSDPStrategy(algorithm="lion",
    mode="1bit")``, ``LowBitFSDPStrategy(config="lowbit.yaml")`` or a registered name such as
    ``strategy="lowbit_lion_fsdp"``. Keyword arguments that :class:`LowBitConfig` accepts
    override ``config``; ``shard_modules``: the block classes to shard as units (default:
    :func:`repeated_blocks`' rule); the rest go to ``ModelParallelStrategy``
    (``save_distributed_checkpoint``, ``process_group_backend``, ``timeout``).
    """

    strategy_name = "lowbit_fsdp"
    #: the registered name this strategy was made under (set by the registry's factory)
    _lowbit_name: str

    def __init__(
        self,
        config: LowBitConfig | dict | str | None = None,
        shard_modules: tuple[type[nn.Module], ...] | None = None,
        **kwargs: Any,
    ) -> None:
        sizes = [k for k in ("data_parallel_size", "tensor_parallel_size") if k in kwargs]
        if sizes:
            raise LowBitSetupError(
                f"LowBitFSDPStrategy builds its own mesh, nodes x devices (lowbit_strategy.node_mesh); remove "
                f"{', '.join(sizes)} (set the layout with Trainer(num_nodes=..., devices=...))"
            )
        self.lowbit_config = config_from(config, kwargs)
        self.algorithm = algorithms.get(self.lowbit_config.algorithm)
        self.shard_modules = tuple(shard_modules) if shard_modules is not None else None
        self.sync: Sync | None = None
        super().__init__(**kwargs)

    def configure_lowbit(self, **overrides: Any) -> None:
        """Change :attr:`lowbit_config` fields before ``fit`` sets the strategy up (as
        :meth:`LowBitStrategy.configure_lowbit <lowbit_strategy.LowBitStrategy.configure_lowbit>`)."""
        self.lowbit_config = self.lowbit_config.replace(**overrides)

    # ---- mesh, sampler, sharding, wiring --------------------------------------------
    def setup_environment(self) -> None:
        self._setup_distributed()  # the base's process group (gloo on CPU), without its own mesh
        destroy_process_group_at_exit()  # Lightning destroys it at exit only for NCCL
        cfg = self.lowbit_config
        if cfg.ranks_per_node is None:  # Lightning's launcher exports no LOCAL_WORLD_SIZE
            cfg = self.lowbit_config = cfg.replace(ranks_per_node=self.num_processes)
        self._device_mesh = sharding_mesh(self.root_device.type, cfg)
        module = self.lightning_module
        if module is None:
            raise RuntimeError("LowBitFSDPStrategy.setup_environment: no LightningModule is connected")
        module._device_mesh = self._device_mesh  # self.device_mesh in configure_model

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank is a data-parallel worker (the ranks of a node see different batches)
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup(self, trainer) -> None:
        """The base's setup, with sharding for a module that does not shard itself (the base
        requires ``configure_model`` to do it) and ``attach_sharded`` once the optimizers exist."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        self.algorithm.check_precision(getattr(self.precision_plugin, "precision", None))
        if self.model is None or self.accelerator is None:
            raise RuntimeError("LowBitFSDPStrategy.setup: no model or accelerator is connected")
        self.accelerator.setup(trainer)
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise LowBitSetupError(
                "LowBitFSDPStrategy runs FSDP2 (torch.distributed.fsdp.fully_shard), not FullyShardedDataParallel "
                "(FSDP1): shard with fully_shard(block, mesh=self.device_mesh['shard']) in configure_model, "
                "or not at all"
            )
        self.model = self._sharded_root()
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
            self.sync = attach_sharded(
                self._module(),
                [_lightning.unwrap_optimizer(o) for o in self.optimizers],
                self.lowbit_config,
                mesh=self.device_mesh,
                root=self.model,
            )
            reason = _lightning.gradients_change_after_backward(trainer, self._module())
            if reason:
                self.sync.disable_overlap(
                    f"{reason} may change the gradients after backward, so the synchronized "
                    "update must be formed in optimizer.step()"
                )

    def _module(self) -> nn.Module:
        module = self.lightning_module
        if module is None:
            raise RuntimeError("LowBitFSDPStrategy: no LightningModule is connected")
        return module

    def _sharded_root(self) -> nn.Module:
        """The module Lightning runs: the LightningModule when its ``configure_model`` sharded
        it, else (the first time) its blocks and a :class:`_Root` holding it, sharded over the
        node; a module sharded here before (``validate`` after ``fit``) gets its root back."""
        from torch.distributed.fsdp import fully_shard

        module = self._module()
        root = module.__dict__.get("_lowbit_fsdp_root")
        if root is not None:
            return root
        fsdp = fsdp_module_class()
        if fsdp is not None and any(isinstance(m, fsdp) for m in module.modules()):
            return module  # configure_model sharded it: left as it is (attach_sharded checks it)
        mesh = self.device_mesh["shard"]
        blocks = repeated_blocks(module, self.shard_modules)
        for block in blocks:
            fully_shard(block, mesh=mesh)
        root = _Root(module)
        fully_shard(root, mesh=mesh)
        object.__setattr__(module, "_lowbit_fsdp_root", root)  # not a submodule: no cycle in modules()
        logger.info(
            "lowbit: sharded %d block(s) (%s) and the root of %s over each node's %d rank(s)",
            len(blocks),
            ", ".join(sorted({type(b).__name__ for b in blocks})) or "none",
            type(module).__name__,
            mesh.size(),
        )
        return root

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Non-final micro-batches of gradient accumulation: no FSDP gradient sync (no node
        reduce-scatter, so no exchange across nodes); gradients accumulate unsharded."""
        fsdp, model = fsdp_module_class(), self.model
        units: list[Any] = [] if fsdp is None or model is None else [m for m in model.modules() if isinstance(m, fsdp)]
        for unit in units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            yield None
        finally:
            for unit in units:
                unit.set_requires_gradient_sync(True, recurse=False)

    def teardown(self) -> None:
        # the optimizers outlive the run as plain optimizers; the sync stays for its traffic and state
        if self.sync is not None:
            self.sync.detach()
        super().teardown()

    def traffic_logs(self) -> list[TrafficLog]:
        """The traffic logs of the current run (after ``fit`` returns, of the finished one)."""
        return self.sync.traffic_logs() if self.sync is not None else []

    # ---- checkpoints -----------------------------------------------------------------
    @contextmanager
    def _named_by_module(self) -> Iterator[None]:
        """The base's state-dict code reads ``self.model``: give it the LightningModule, so
        that names are the module's (not ``module.``-prefixed by :class:`_Root`)."""
        model = self.model
        self.model = self._module()
        try:
            yield
        finally:
            self.model = model

    def lightning_module_state_dict(self) -> dict[str, Any]:
        with self._named_by_module():
            return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        with self._named_by_module():
            return super().optimizer_state(optimizer)

    def _rank_dir(self, path: Path, saving: bool) -> Path:
        sharded = self._save_distributed_checkpoint if saving else _is_sharded_checkpoint(path)
        return path / "lowbit" if sharded else Path(_lightning.sidecar_dir(path, resolve=not saving))

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options=None) -> None:
        """The base's checkpoint, plus every rank's rank-local state in a file of its own
        (module docstring; the checkpoint's metadata holds their index). Every rank calls
        this; a failure on any rank raises on every rank."""
        path = Path(self.broadcast(filepath))
        with_state = self.sync is not None and "optimizer_states" in checkpoint
        if with_state:  # rank_state.save_files' index, known before the files are written
            entry = {"world_size": self.world_size, "format": "files", "algorithm": self.lowbit_config.algorithm}
            checkpoint = {**checkpoint, rank_state.KEY: entry}
        rank_state.together(
            "save_checkpoint",
            lambda: super(LowBitFSDPStrategy, self).save_checkpoint(checkpoint, path, storage_options),
        )
        if with_state:
            sync = cast(Sync, self.sync)
            rank_state.save_files(sync.state_dict(), self._rank_dir(path, saving=True), sync.group)

    def remove_checkpoint(self, filepath) -> None:
        """The base's removal (rank 0; a DCP directory goes with its ``lowbit/``), and this
        rank's file beside a single-file checkpoint."""
        super().remove_checkpoint(filepath)
        if not self._save_distributed_checkpoint:
            rank_state.remove_files(
                _lightning.sidecar_dir(filepath), self.sync.group if self.sync is not None else None
            )

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """The base's load (model and optimizers, by the LightningModule's names), then this
        rank's own rank-local state."""
        path = Path(self.broadcast(checkpoint_path))
        with self._named_by_module():
            checkpoint = super().load_checkpoint(path, weights_only=weights_only)
        if self.sync is None:
            return checkpoint
        entry = checkpoint.get(rank_state.KEY)
        algorithm = self.lowbit_config.algorithm
        if entry is None or entry.get("algorithm") != algorithm:
            logger.warning(
                "lowbit: the checkpoint holds no %s rank-local state; every rank keeps the optimizer state loaded",
                algorithm,
            )
            return checkpoint
        what = f"{algorithm} rank-local buffers"
        directory = self._rank_dir(path, saving=False)
        state = rank_state.load_files(entry, directory, self.algorithm.merge_states, what, self.sync.group)
        self.sync.load_state_dict(state)
        return checkpoint


# ---- registered names -----------------------------------------------------------------
def sharded_strategy_names() -> dict[str, tuple[algorithms.Algorithm, dict[str, Any]]]:
    """``<primary name>_fsdp`` -> (algorithm, the primary name's init arguments) for every
    algorithm with Lightning names (its primary name: the first). Registered for every
    algorithm: one with no sharded form yet raises at setup (``attach_sharded`` names it)."""
    out = {}
    for algo in algorithms.REGISTRY.values():
        if algo.strategy_names:
            base, kwargs = next(iter(algo.strategy_names.items()))
            out[base + SUFFIX] = (algo, dict(kwargs))
    return out


def register_sharded_strategies(registry=StrategyRegistry) -> list[str]:
    """Register :func:`sharded_strategy_names` (idempotent). No ``_spawn``/``_notebook``
    variants: ``ModelParallelStrategy`` launches by re-running the script only."""
    for name, (algo, cfg) in sharded_strategy_names().items():
        registry.register(
            name,
            named_factory(name, LowBitFSDPStrategy),
            description=f"{algo.summary}, FSDP2 inside each node, the low-bit exchange across nodes",
            override=True,
            **cfg,
        )
    return list(sharded_strategy_names())


register_sharded_strategies()  # importing this module is what registers the names
