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
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from lowbit_strategy import algorithms, rank_state
from lowbit_strategy.algorithms.base import Sync, keep_local_gradients
from lowbit_strategy.config import LowBitConfig
from lowbit_strategy.selection import unwrap

logger = logging.getLogger(__name__)

__all__ = ["attach", "build_sync", "keep_local_gradients", "load_rank_states", "save_rank_states"]


def build_sync(config: LowBitConfig, module: torch.nn.Module, group: dist.ProcessGroup | None = None) -> Sync:
    """The registered algorithm's :class:`Sync` for ``module`` (unwrapped from DDP)."""
    algo = algorithms.get(config.algorithm)
    sync = algo.build(config, unwrap(module), group)
    sync.algorithm = algo
    return sync


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
    sync.attach(list(optimizers))
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
    (once, however often it is called). A gloo group left to interpreter finalization
    sometimes aborts a process after training ends: gloo's worker threads still hold work
    whose tensors need the GIL while Python is being torn down ("terminate called without
    an active exception", SIGABRT, ~1 run in 10 here), which launchers report as a failed
    run. Lightning and Accelerate destroy the group at exit only for NCCL."""
    atexit.unregister(_destroy_process_group)
    atexit.register(_destroy_process_group)
