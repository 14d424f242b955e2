"""The sharded form of :class:`~lowbit_strategy.integrations.accelerate.LowBitAccelerator`:
FSDP2 inside each node, the algorithm's low-bit exchange across nodes (as
:func:`~lowbit_strategy.attach_sharded`), from an Accelerate FSDP2 configuration.

Migrating an Accelerate FSDP2 script is the same one line as a DDP script::

    accelerator = LowBitAccelerator()   # was: Accelerator(); an accelerate config with fsdp_version: 2
    accelerator = LowBitAccelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

**Why the accelerator shards the model itself.** Accelerate's own FSDP2 path cannot carry the
node-sharded form: it shards over every rank (an FSDP group spanning nodes sends each
reduce-scatter across the network), it never enables FSDP for multi-process CPU runs (its
``state.py`` switches to ``DistributedType.FSDP`` only in the GPU-like branches), and
``prepare(model)`` of a model it did not shard wraps it in DDP, which fails on DTensors. So
when the plugin asks for FSDP2 (the ``fsdp_plugin`` argument, or the ``ACCELERATE_USE_FSDP`` /
``FSDP_VERSION=2`` environment ``accelerate launch`` exports from a config file), or when a
model handed to ``prepare`` is already ``fully_shard``-ed, the accelerator takes the plugin
for itself and lets Accelerate set up a plain multi-process run (``MULTI_GPU`` / ``MULTI_CPU``),
the same path on GPUs and CPUs:

* ``prepare_model``: the model is sharded over :func:`lowbit_strategy.sharding_mesh`'s
  ``mesh["shard"]`` (the node, by default): first the blocks the plugin's auto-wrap policy
  names (``transformer_cls_names_to_wrap``, else the model's ``_no_split_modules``; a
  size-based policy's ``min_num_params``), then the root, with the plugin's
  ``mixed_precision_policy`` / ``reshard_after_forward``; a model that is already sharded is
  left as it is. Accelerate then prepares it without DDP (its ``evaluation_mode``: autocast
  and compilation only), and :func:`~lowbit_strategy.attach_sharded` wires the algorithm.
  Optimizers built on the unsharded parameters (before ``prepare``, as usual) get the
  sharded ones in their place, as Accelerate's own FSDP2 path does.
* gradient accumulation (``accumulate`` / ``no_sync``): FSDP2's gradient sync is off on the
  non-final micro-batches (``set_requires_gradient_sync``), so the node reduce-scatter and
  the exchange across nodes run once per optimizer step.
* ``clip_grad_norm_``: Accelerate's DTensor-aware clipping; the norm is the node's gradient's.
  Optimizer-level algorithms start their exchange during backward (FSDP2's post-accumulate-grad
  hooks, :func:`~lowbit_strategy.attach_sharded`), before any clipping: as for DDP, clipping
  needs ``LowBitAccelerator(..., overlap=False)``, which moves the exchange to ``step()``.
* ``save_state`` / ``load_state``: each sharded model and its optimizers through
  ``torch.distributed.checkpoint`` (``sharded_model_<k>/``), Accelerate's own files for the
  rest (schedulers, RNG states, dataloaders, step), and every rank's low-bit state as for DDP.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from lowbit_strategy.algorithms.base import LowBitSetupError
from lowbit_strategy.integrations.sharded import attach_sharded, fsdp_module_class, sharding_mesh

logger = logging.getLogger(__name__)

#: the directory of the ``k``-th sharded model's DCP checkpoint inside a ``save_state`` folder
SHARDED_DIR = "sharded_model_{}"


def take_fsdp_plugin(kwargs: dict[str, Any], who: str) -> Any | None:
    """The FSDP2 plugin this accelerator asks for (the ``fsdp_plugin`` argument, else the
    environment ``accelerate launch`` exports from a config file), removed from ``kwargs``;
    None when none is asked for. FSDP1 is refused, naming the fix."""
    plugin = kwargs.pop("fsdp_plugin", None)
    if plugin is None and str(os.environ.get("ACCELERATE_USE_FSDP", "")).lower() == "true":
        from accelerate.utils import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin()  # reads FSDP_VERSION, FSDP_* as Accelerate does
    if plugin is None:
        return None
    version = getattr(plugin, "fsdp_version", None)
    if version != 2:
        raise LowBitSetupError(
            f"{who}: fsdp_version={version!r}: the sharded form runs FSDP2 (fully_shard) inside each node; "
            "set fsdp_version: 2 in the accelerate config (FullyShardedDataParallelPlugin(fsdp_version=2); the "
            "Trainer: fsdp_config={'fsdp_version': 2}), or drop FSDP for the replicated (DDP) form"
        )
    return plugin


@contextlib.contextmanager
def fsdp_env_off() -> Iterator[None]:
    """Accelerate's state switches to ``DistributedType.FSDP`` (GPU only) when
    ``ACCELERATE_USE_FSDP=true``: off while the accelerator sets up, so that every device takes
    the plain multi-process path; restored afterwards."""
    before = os.environ.get("ACCELERATE_USE_FSDP")
    os.environ["ACCELERATE_USE_FSDP"] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("ACCELERATE_USE_FSDP", None)
        else:
            os.environ["ACCELERATE_USE_FSDP"] = before


def is_sharded(model: torch.nn.Module) -> bool:
    cls = fsdp_module_class()
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def wrap_classes(plugin: Any, model: torch.nn.Module) -> set[type]:
    """The block classes to shard as units: the plugin's ``transformer_cls_names_to_wrap``, else
    the model's ``_no_split_modules`` (Accelerate's transformer policy); none without either."""
    names = getattr(plugin, "transformer_cls_names_to_wrap", None) if plugin is not None else None
    if names is None:
        names = getattr(model, "_no_split_modules", None) or []
    if isinstance(names, str):  # (the Trainer's fsdp_config hands a comma-separated string)
        names = [n.strip() for n in names.split(",") if n.strip()]
    by_name = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise LowBitSetupError(
            f"transformer_cls_names_to_wrap={list(names)!r}: the model has no module class named {missing}; "
            f"name classes it holds (e.g. {sorted(by_name)[:6]})"
        )
    return {by_name[n] for n in names}


def shard_model(model: torch.nn.Module, mesh, plugin: Any) -> list[torch.nn.Module]:
    """``fully_shard`` the plugin's blocks (:func:`wrap_classes`, or a size-based policy's
    modules of ``min_num_params`` parameters or more), then ``model``, over ``mesh``; the blocks."""
    from torch.distributed.fsdp import fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh}
    if plugin is not None:
        if plugin.mixed_precision_policy is not None:
            kwargs["mp_policy"] = plugin.mixed_precision_policy
        kwargs["reshard_after_forward"] = plugin.reshard_after_forward
    policy = getattr(plugin, "auto_wrap_policy", None)
    size_based = getattr(getattr(policy, "func", policy), "__name__", "") == "size_based_auto_wrap_policy"
    if size_based:
        least = int(getattr(plugin, "min_num_params", 0) or 0)
        classes: set[type] = set()
    else:
        classes = wrap_classes(plugin, model)
    blocks: list[torch.nn.Module] = []

    def walk(module: torch.nn.Module) -> None:  # outermost matches first, children before the parent
        for child in module.children():
            if isinstance(child, tuple(classes)) or (
                size_based and sum(p.numel() for p in child.parameters()) >= least > 0
            ):
                blocks.append(child)
            else:
                walk(child)

    walk(model)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return blocks


def switch_parameters(optimizer: torch.optim.Optimizer, mapping: dict[int, torch.nn.Parameter]) -> None:
    """Put the sharded parameters in place of the unsharded ones an optimizer was built on."""
    if not any(id(p) in mapping for g in optimizer.param_groups for p in g["params"]):
        return
    if optimizer.state:
        raise LowBitSetupError(
            "an optimizer that has already stepped holds the model's unsharded parameters: prepare the model "
            "before the first optimizer.step()"
        )
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]


class ShardedModels:
    """The sharded-model half of :class:`~lowbit_strategy.integrations.accelerate.LowBitAccelerator`
    (module docstring)."""

    if TYPE_CHECKING:  # provided by LowBitAccelerator and Accelerator
        lowbit_config: Any
        lowbit_fsdp_plugin: Any
        num_processes: int
        device: torch.device
        _lowbit_prepared: list[Any]
        _lowbit_remap: dict[int, torch.nn.Parameter]
        _models: list[Any]
        _optimizers: list[Any]
        _lowbit_hidden: list[Any]

        def _attach_optimizers(self) -> None: ...

        def _record_sharded(self, model: torch.nn.Module, sync: Any, nodes: int) -> None: ...

    def _wants_sharding(self, model: torch.nn.Module) -> bool:
        return self.lowbit_fsdp_plugin is not None or is_sharded(model)

    def _prepare_sharded(self, model: torch.nn.Module, prepare: Any) -> torch.nn.Module:
        """Shard ``model`` over the node (unless it is sharded), have Accelerate prepare it
        without DDP (``prepare(model)``), then attach the algorithm."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise LowBitSetupError(
                "LowBitAccelerator with FSDP2 needs several launched processes (accelerate launch / torchrun); "
                "on one process drop fsdp_plugin / the FSDP config"
            )
        root = getattr(model, "_orig_mod", model)
        mesh = sharding_mesh(self.device.type, self.lowbit_config)
        if not is_sharded(root):
            old = {name: id(p) for name, p in root.named_parameters()}
            blocks = shard_model(root, mesh["shard"], self.lowbit_fsdp_plugin)
            new = dict(root.named_parameters())
            self._lowbit_remap.update({old[n]: new[n] for n in old if n in new})
            for opt in self._optimizers:
                switch_parameters(getattr(opt, "optimizer", opt), self._lowbit_remap)
            logger.info(
                "lowbit: sharded %d block(s) (%s) and the root of %s over %d rank(s) (mesh %s)",
                len(blocks),
                ", ".join(sorted({type(b).__name__ for b in blocks})) or "none",
                type(root).__name__,
                mesh["shard"].size(),
                tuple(mesh.shape),
            )
        prepared = prepare(model)
        sync = attach_sharded(root, [], self.lowbit_config, mesh=mesh)
        self._record_sharded(root, sync, mesh["replicate"].size())
        self._attach_optimizers()
        return prepared

    @contextlib.contextmanager
    def _sharded_no_sync(self, model: torch.nn.Module) -> Iterator[bool]:
        """FSDP2's gradient sync off for a sharded model (yields True), else nothing (False)."""
        root: Any = getattr(model, "_orig_mod", model)
        if not (
            any(root is p.model and p.nodes for p in self._lowbit_prepared)
            and hasattr(root, "set_requires_gradient_sync")
        ):
            yield False
            return
        root.set_requires_gradient_sync(False)
        try:
            yield True
        finally:
            root.set_requires_gradient_sync(True)

    # ---- checkpoints ----------------------------------------------------------------
    def _sharded(self) -> list[tuple[int, Any, list[torch.optim.Optimizer]]]:
        """(k, prepared entry, its optimizers) of every sharded model, in prepare order."""
        out = []
        for k, p in enumerate(x for x in self._lowbit_prepared if x.nodes):
            owned = {id(q) for q in p.model.parameters()}
            opts = [
                getattr(o, "optimizer", o)
                for o in [*self._optimizers, *self._lowbit_hidden]
                if any(id(q) in owned for g in getattr(o, "optimizer", o).param_groups for q in g["params"])
            ]
            out.append((k, p, opts))
        return out

    @contextlib.contextmanager
    def _without_sharded(self) -> Iterator[None]:
        """Accelerate's ``save_state`` / ``load_state`` see only the models and optimizers they
        can save (the sharded ones go through DCP): hidden meanwhile, their order kept."""
        sharded = self._sharded()
        models = {id(p.model) for _, p, _ in sharded}
        opts = {id(o) for _, _, os_ in sharded for o in os_}
        kept_models, kept_opts = list(self._models), list(self._optimizers)
        self._models[:] = [m for m in kept_models if id(getattr(m, "_orig_mod", m)) not in models]
        self._optimizers[:] = [o for o in kept_opts if id(getattr(o, "optimizer", o)) not in opts]
        self._lowbit_hidden = [o for o in kept_opts if id(getattr(o, "optimizer", o)) in opts]  # (still saved)
        try:
            yield
        finally:
            self._models[:] = kept_models
            self._optimizers[:] = kept_opts
            self._lowbit_hidden = []

    def save_sharded_state(self, output_dir: str) -> None:
        """Each sharded model and its optimizers, through DCP, into ``output_dir/sharded_model_<k>``
        (each rank writes its shards; the replicas on other nodes are identical). Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        for k, p, opts in self._sharded():
            model_sd, optim_sd = get_state_dict(p.model, opts)
            dcp.save(
                {"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(output_dir, SHARDED_DIR.format(k))
            )

    def load_sharded_state(self, input_dir: str) -> None:
        """What :meth:`save_sharded_state` wrote, into the sharded models and their optimizers
        (before each rank's own low-bit state). Collective."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        for k, p, opts in self._sharded():
            path = os.path.join(input_dir, SHARDED_DIR.format(k))
            if not os.path.isdir(path):
                raise FileNotFoundError(
                    f"lowbit: {path} is missing: {input_dir} was not written by a LowBitAccelerator with the same "
                    "sharded models (save_state writes sharded_model_<k>/ for each)"
                )
            model_sd, optim_sd = get_state_dict(p.model, opts)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)  # in place
            set_state_dict(p.model, opts, model_state_dict=model_sd, optim_state_dict=optim_sd)
