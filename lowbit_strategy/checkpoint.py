"""Rank-local optimizer state in checkpoints.

Optimizers driven at the optimizer level (Lion Cub's momentum) and the BitDP hook's
error-feedback residuals keep state that differs across ranks, while frameworks save only
rank 0's optimizer state. :func:`gather_state_dict` (a collective: every rank calls it) adds every rank's
``state`` to rank 0's state dict, keyed by rank; :func:`local_state_dict` picks this
rank's own back out of a loaded checkpoint. Same world size: each rank gets exactly its
own buffers, so a resume continues bit for bit. Different world size: the ranks' buffers
are averaged (the consensus every rank would reach after a full momentum sync) and a
warning says so; they are never mismatched silently. :func:`gather_rank_objects` and
:func:`pick_rank_state` do the same for any per-rank state (BitDP's, under :data:`BITDP_KEY`).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
KEY = "lowbit_rank_states"
BITDP_KEY = "lowbit_bitdp_states"


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def gather_rank_objects(obj: Any, group=None) -> dict[str, Any] | None:
    """``{"world_size": P, "states": [rank 0's obj, ..., rank P-1's]}`` (tensors copied to
    CPU) on rank 0 of ``group``, None elsewhere. Collective: call it on every rank."""
    obj = _to_cpu(obj)
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {"world_size": 1, "states": [obj]}
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(obj, gathered, dst=dist.get_global_rank(group, 0) if group else 0, group=group)
    return {"world_size": world, "states": gathered} if rank == 0 else None


def pick_rank_state(entry: dict[str, Any], rank: int, world_size: int, merge, what: str) -> Any:
    """This rank's own state from a :func:`gather_rank_objects` entry; at another world size
    ``merge(states)`` of all saved ranks, with a warning naming ``what``."""
    if entry["world_size"] == world_size:
        return entry["states"][rank]
    log.warning(
        "lowbit: checkpoint written with world size %d, resuming with %d; %s are reset to their "
        "mean over the saved ranks", entry["world_size"], world_size, what,
    )
    return merge(entry["states"])


def gather_state_dict(optimizer: torch.optim.Optimizer, group=None) -> dict[str, Any]:
    """``optimizer.state_dict()`` plus every rank's ``state`` under :data:`KEY` (on rank 0;
    other ranks get their plain state dict). Collective: call it on every rank."""
    sd = optimizer.state_dict()
    ranks = gather_rank_objects(sd["state"], group)
    return sd if ranks is None else {**sd, KEY: ranks}


def _mean_states(states: list[dict]) -> dict:
    out: dict = {}
    for idx, first in states[0].items():
        out[idx] = {}
        for name, value in first.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and all(idx in s for s in states):
                out[idx][name] = torch.stack([s[idx][name].float() for s in states]).mean(0).to(value.dtype)
            else:
                out[idx][name] = value
    return out


def local_state_dict(saved: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """The state dict this rank should load from a checkpoint written by :func:`gather_state_dict`."""
    ranks = saved.get(KEY)
    plain = {k: v for k, v in saved.items() if k != KEY}
    if ranks is None:
        log.warning("lowbit: the checkpoint holds only one rank's optimizer state; every rank loads it")
        return plain
    return {**plain, "state": pick_rank_state(ranks, rank, world_size, _mean_states, "rank-local optimizer buffers")}


def mean_bitdp_states(states: list[dict]) -> dict:
    """BitDP hook state for another world size: rank 0's iteration count and the mean
    residual, which carries the same untransmitted part of the mean gradient
    (Σ_r e_r / P) into every new rank."""
    names = set.intersection(*(set(s["residuals"]) for s in states))
    return {"iter": states[0]["iter"],
            "residuals": {n: torch.stack([s["residuals"][n] for s in states]).mean(0) for n in sorted(names)}}
