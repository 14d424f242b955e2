"""The plain-DDP front end: any registered algorithm on a ``DistributedDataParallel`` model.

::

    ddp = DistributedDataParallel(model)
    opt = lowbit_strategy.Lion(ddp.parameters(), lr=3e-4)
    sync = lowbit_strategy.attach(ddp, [opt], LowBitConfig(algorithm="lion", mode="1bit"))
    ...                                         # train as usual: loss.backward(); opt.step()
    sync.traffic_logs()[0].bytes_sent           # bytes this rank put on the wire
    entry = save_rank_states(sync)              # collective; rank 0 gets every rank's state
    load_rank_states(sync, entry)               # on resume, each rank its own

The Lightning strategy (and the Accelerate front end) are built on the same three calls.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lowbit_strategy import algorithms, rank_state
from lowbit_strategy.algorithms.base import LowBitSetupError, Sync, keep_local_gradients
from lowbit_strategy.codecs import compiled
from lowbit_strategy.collectives import hierarchy
from lowbit_strategy.collectives.agreement import check_same
from lowbit_strategy.config import LowBitConfig
from lowbit_strategy.pricing import link_probe
from lowbit_strategy.roles import unwrap
from lowbit_strategy.validation import ConfigMismatchError
from lowbit_strategy.version import installed_version

logger = logging.getLogger(__name__)

__all__ = ["attach", "build_sync", "keep_local_gradients", "load_rank_states", "save_rank_states"]


def build_sync(
    config: LowBitConfig,
    module: torch.nn.Module,
    group: dist.ProcessGroup | None = None,
    ranks_per_node: int | None = None,
) -> Sync:
    """The registered algorithm's :class:`Sync` for ``module`` (unwrapped from DDP), after
    the configuration handshake: every rank compares the resolved configuration, the package
    version and the model's parameters (one small collective, before any other), and a
    difference raises the same :class:`~lowbit_strategy.validation.ConfigMismatchError` on
    every rank, naming the fields and the ranks. Then the node layout
    (:func:`~lowbit_strategy.collectives.hierarchy.resolve`; ``ranks_per_node``: a front end's
    hint, e.g. Lightning's devices per node) gives the sync its :class:`Topology`. A link
    field set to ``"measure"`` is then resolved, on every rank alike, by a short probe of the
    link (:func:`~lowbit_strategy.pricing.link_probe.resolve_config`, over the cross-node
    groups of a hierarchical topology) before the algorithm is built, so its ``auto`` plans
    and ``sync.config`` hold the measured figures."""
    module = unwrap(module)
    check_same(setup_fingerprint(config, module), group, "The low-bit setup", ConfigMismatchError)
    # every front end comes through here: the codecs' compiled chains on or off for the process, as all ranks agreed
    compiled.use_compiled(config.compile_codecs)
    algo = algorithms.get(config.algorithm)
    topology = hierarchy.resolve(config, group, ranks_per_node)
    if topology.hierarchical and not algo.hierarchical:
        if config.topology == "hierarchical":
            raise LowBitSetupError(
                f"topology='hierarchical': {config.algorithm} has no hierarchical form yet; "
                "use topology='flat' (or 'auto', which falls back to flat for it)"
            )
        logger.info("lowbit: %s has no hierarchical form yet: synchronizing flat over all ranks", config.algorithm)
        topology = dataclasses.replace(topology, hierarchical=False, intra=None, inter=None)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    config = link_probe.resolve_config(config, group, topology, device)
    sync = algo.build(config, module, group)
    sync.algorithm = algo
    sync.topology = topology
    if topology.hierarchical:
        logger.info("lowbit: %s synchronizes %s", config.algorithm, topology.describe())
    return sync


def setup_fingerprint(config: LowBitConfig, module: torch.nn.Module) -> dict[str, Any]:
    """What every rank of a run must agree on before the first collective: every field of
    the resolved configuration (``lion.bits``, ``debug``, ...), the package version, and the
    model's parameters (names, shapes, dtypes, which are trained), which fix the buckets."""
    fields: dict[str, Any] = {}
    for key, value in config.to_dict().items():
        if isinstance(value, Mapping):
            fields.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            fields[key] = value
    fields["lowbit_strategy version"] = installed_version()
    fields["model parameters"] = [
        (n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in module.named_parameters()
    ]
    return fields


def attach_optimizers(sync: Sync, optimizers: Sequence[torch.optim.Optimizer], who: str = "") -> None:
    """``sync.attach(optimizers, who)`` after every rank has checked that all ranks pass the
    same kinds of optimizers (class, parameter groups and their hyperparameters) and the same
    ``overlap`` (one small collective): else the same
    :class:`~lowbit_strategy.validation.ConfigMismatchError` on every rank."""
    fields: dict[str, Any] = {"overlap": sync.overlap}
    for i, opt in enumerate(optimizers):
        fields[f"optimizer[{i}]"] = f"{type(opt).__module__}.{type(opt).__qualname__}"
        for j, grp in enumerate(opt.param_groups):
            fields[f"optimizer[{i}].param_groups[{j}]"] = (
                [tuple(p.shape) for p in grp["params"]],
                {k: v for k, v in grp.items() if k != "params"},
            )
    check_same(fields, sync.group, "The optimizers", ConfigMismatchError)
    for opt in optimizers:  # an optimizer that only its own algorithm drives (DeMo's exchange)
        own = getattr(opt, "lowbit_algorithm", None)
        if own is not None and own != sync.config.algorithm:
            raise LowBitSetupError(
                f"{who or 'attach'}: {type(opt).__name__} runs only under algorithm={own!r} (strategy "
                f"'lowbit_{own}'), got the pair (algorithm={sync.config.algorithm!r}, {type(opt).__name__}): "
                f"use algorithm={own!r}, or this algorithm's own optimizer"
            )
    sync.attach(list(optimizers), who=who)


def attach(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    config: LowBitConfig | Mapping[str, Any] | str | None = None,
    group: dist.ProcessGroup | None = None,
    **overrides: Any,
) -> Sync:
    """Run ``config.algorithm`` on ``ddp_model``: registers its communication hook (call
    before the first backward) and wires ``optimizers``. ``config`` is a
    :class:`LowBitConfig`, a dict or a YAML path; keyword arguments override its fields.

    Optimizer-level algorithms (Lion Cub) form what they send from each bucket's gradients
    during backward: if you change gradients between ``backward()`` and ``step()``
    (``clip_grad_norm_``, manual scaling), pass ``overlap=False`` (or call
    ``sync.disable_overlap(reason)``) so that synchronization waits for ``step()``."""
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"attach needs the DistributedDataParallel model, got {type(ddp_model).__name__}; "
            "wrap it first: DistributedDataParallel(model)"
        )
    cfg = LowBitConfig.coerce(config, **overrides)
    sync = build_sync(cfg, ddp_model, group)
    ddp_model.register_comm_hook(sync.hook_state, sync.comm_hook)
    attach_optimizers(sync, list(optimizers))
    return sync


def save_rank_states(sync: Sync, directory: str | os.PathLike | None = None) -> dict[str, Any] | None:
    """Every rank's :meth:`Sync.state_dict` for a checkpoint. Collective: call it on every
    rank; store the return value (rank 0's; None on the others) in the checkpoint.

    With ``directory`` (recommended): every rank writes its own state to a file of its own
    there, and the return value is their small index: no rank holds another rank's state,
    and a failed write on any rank raises on every rank. Without: every rank's state is
    gathered into the return value on rank 0 (one rank at a time, over a CPU group)."""
    if directory is not None:
        return rank_state.save_files(sync.state_dict(), directory, sync.group)
    return rank_state.gather(sync.state_dict(), sync.group)


def load_rank_states(sync: Sync, entry: Mapping[str, Any], directory: str | os.PathLike | None = None) -> None:
    """Restore this rank's own state from :func:`save_rank_states`'s entry (and the
    ``directory`` it wrote to, if it wrote files; a rank that cannot see its file makes every
    rank raise). At another world size, the algorithm's merge of all saved ranks, with a
    logged warning."""
    group = sync.group
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank(group) if world > 1 else 0
    merge = sync.algorithm.merge_states if sync.algorithm is not None else None
    if merge is None and entry["world_size"] != world:
        raise ValueError(
            "load_rank_states: another world size needs the algorithm's merge; build the sync with build_sync/attach"
        )
    what = f"{sync.config.algorithm} rank-local buffers"
    if entry.get("format") == "files":
        if directory is None:
            raise ValueError(
                "load_rank_states: the entry indexes per-rank files; pass the directory they were saved to"
            )
        sync.load_state_dict(rank_state.load_files(dict(entry), directory, merge, what, group))
        return
    sync.load_state_dict(rank_state.pick(dict(entry), rank, world, merge, what))


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def destroy_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, before finalization
    (once, however often it is called): Lightning and Accelerate destroy it at exit only
    for NCCL. (What kept gloo processes from exiting cleanly was a Python callback still
    held by one of gloo's worker threads when the interpreter finalizes; every process that
    imports the package waits for those at exit: :func:`.collectives.chain.settle`.)"""
    atexit.unregister(_destroy_process_group)
    atexit.register(_destroy_process_group)
