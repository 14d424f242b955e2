"""Rank-local state in checkpoints, for every algorithm.

Frameworks save rank 0's optimizer state only, but Lion Cub's momenta, BitDP's
error-feedback residuals (and every error-feedback method's buffers) differ across ranks.
Each algorithm's :meth:`~lowbit_strategy.algorithms.Sync.state_dict` is this rank's share;
:func:`gather` (a collective: every rank calls it) collects every rank's into one entry,
stored in the checkpoint under :data:`KEY`; :func:`pick` hands each rank its own back.
Same world size: each rank gets exactly its own buffers, so a resume continues bit for
bit. Another world size: the algorithm's ``merge_states`` builds one state for every rank
(the mean, for momenta and residuals; 1-bit Adam/LAMB restart their errors at 0), with a
logged warning quoting its rule; never a silent mismatch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: where front ends store the gathered entry in a checkpoint
KEY = "lowbit_rank_states"


def to_cpu(obj: Any) -> Any:
    """Copies of every tensor in nested dicts/lists, on CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def gather(obj: Any, group=None) -> dict[str, Any] | None:
    """``{"world_size": P, "states": [rank 0's obj, ..., rank P-1's]}`` (tensors copied to
    CPU) on rank 0 of ``group``, None on the other ranks. Collective: call it on every rank.

    The states travel one rank at a time over a CPU process group (``group`` itself on gloo,
    else a gloo group over the same ranks, made once): never through a GPU (NCCL's object
    collectives would stage every rank's state on rank 0's device: 1B parameters x P = 16 is
    ~64 GB), and never more than one state in flight. Rank 0's entry holds every rank's
    state, as the single checkpoint file it is written to does."""
    obj = to_cpu(obj)
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {"world_size": 1, "states": [obj]}
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    cpu = _cpu_group(group)
    if rank != 0:
        dist.send_object_list([obj], dst=dist.get_global_rank(cpu, 0), group=cpu)
        return None
    states = [obj]
    for r in range(1, world):  # rank order, one state at a time
        box: list[Any] = [None]
        dist.recv_object_list(box, src=dist.get_global_rank(cpu, r), group=cpu)
        states.append(box[0])
    return {"world_size": world, "states": states}


_CPU_GROUPS: dict[Any, Any] = {}


def _cpu_group(group):
    """A process group over ``group``'s ranks that moves CPU tensors: ``group`` itself when
    its backend is gloo alone, else a gloo group made on first use (only the member ranks
    take part, ``use_local_synchronization``) and kept."""
    if dist.get_backend(group) == "gloo":
        return group if group is not None else dist.group.WORLD
    key = (id(dist.group.WORLD), id(group))  # a new default group (after re-initialization) gets its own
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = dist.new_group(
            dist.get_process_group_ranks(group if group is not None else dist.group.WORLD),
            backend="gloo",
            use_local_synchronization=True,
        )
    return _CPU_GROUPS[key]


def pick(entry: dict[str, Any], rank: int, world_size: int, merge: Callable[[list], Any] | None, what: str) -> Any:
    """This rank's own state from a :func:`gather` entry; at another world size
    ``merge(states)`` of all saved ranks, with a warning naming ``what`` and quoting the
    merge's docstring (its rule). ``merge`` may be None only when the world size is the same."""
    if entry["world_size"] == world_size:
        return entry["states"][rank]
    if merge is None:
        raise ValueError(
            f"{what}: checkpoint written with world size {entry['world_size']}, resuming with {world_size}, "
            "and no merge rule to rebuild the state"
        )
    rule = " ".join((merge.__doc__ or "merged by the algorithm's rule").split())
    logger.warning(
        "lowbit: checkpoint written with world size %d, resuming with %d; %s: %s",
        entry["world_size"],
        world_size,
        what,
        rule,
    )
    return merge(entry["states"])
