"""Rank-local optimizer state in checkpoints.

Optimizers driven at the optimizer level (Lion Cub's momentum, error-feedback buffers)
keep state that differs across ranks, while frameworks save only rank 0's optimizer
state. :func:`gather_state_dict` (a collective: every rank calls it) adds every rank's
``state`` to rank 0's state dict, keyed by rank; :func:`local_state_dict` picks this
rank's own back out of a loaded checkpoint. Same world size: each rank gets exactly its
own buffers, so a resume continues bit for bit. Different world size: the ranks' buffers
are averaged (the consensus every rank would reach after a full momentum sync) and a
warning says so; they are never mismatched silently.
"""
from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
KEY = "lowbit_rank_states"


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def gather_state_dict(optimizer: torch.optim.Optimizer, group=None) -> dict[str, Any]:
    """``optimizer.state_dict()`` plus every rank's ``state`` under :data:`KEY` (on rank 0;
    other ranks get their plain state dict). Collective: call it on every rank."""
    sd = optimizer.state_dict()
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return {**sd, KEY: {"world_size": 1, "states": [_to_cpu(sd["state"])]}}
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(_to_cpu(sd["state"]), gathered, dst=dist.get_global_rank(group, 0) if group else 0, group=group)
    if rank != 0:
        return sd
    return {**sd, KEY: {"world_size": world, "states": gathered}}


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
    states = ranks["states"]
    if ranks["world_size"] == world_size:
        return {**plain, "state": states[rank]}
    log.warning(
        "lowbit: checkpoint written with world size %d, resuming with %d; rank-local optimizer "
        "buffers are reset to their mean over the saved ranks", ranks["world_size"], world_size,
    )
    return {**plain, "state": _mean_states(states)}
