"""Rank-local state in checkpoints, for every algorithm.

Frameworks save rank 0's optimizer state only, but Lion Cub's momenta, BitDP's
error-feedback residuals (and every error-feedback method's buffers) differ across ranks.
Each algorithm's :meth:`~lowbit_strategy.algorithms.Sync.state_dict` is this rank's share.
Two ways to keep every rank's share (both collectives: every rank calls them):

* **per-rank files** (:func:`save_files` / :func:`load_files`, what the Lightning and
  Accelerate front ends use): every rank writes its own file beside the checkpoint and reads
  its own back, so no rank ever holds more than its own state (O(state of one rank) per rank,
  whatever P); the checkpoint holds a small index under :data:`KEY`. A rank that fails to
  write, or cannot see the file it needs, makes every rank raise, naming the ranks and the
  directory: never a half-saved checkpoint or a silent half-restore;
* **one entry** (:func:`gather` / :func:`pick`): every rank's state collected on rank 0, one
  rank at a time over a CPU group, for a caller that keeps a single checkpoint object.

Same world size: each rank gets exactly its own buffers, so a resume continues bit for bit.
Another world size: the algorithm's ``merge_states`` builds one state for every rank (the
mean, for momenta and residuals; 1-bit Adam/LAMB restart their errors at 0) from every saved
rank's state, with a logged warning quoting its rule; never a silent mismatch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lowbit_strategy.collectives.group import cpu_group
from lowbit_strategy.layout import local_view

logger = logging.getLogger(__name__)

#: where front ends store the gathered entry in a checkpoint
KEY = "lowbit_rank_states"


def to_cpu(obj: Any) -> Any:
    """Copies of every tensor in nested dicts/lists, on CPU; a ``DTensor`` (FSDP2's sharded
    optimizer state) as this rank's local shard: rank-local state is each rank's own."""
    if isinstance(obj, torch.Tensor):
        return local_view(obj).detach().cpu().clone()
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
    cpu = cpu_group(group)
    if rank != 0:
        dist.send_object_list([obj], dst=dist.get_global_rank(cpu, 0), group=cpu)
        return None
    states = [obj]
    for r in range(1, world):  # rank order, one state at a time
        box: list[Any] = [None]
        dist.recv_object_list(box, src=dist.get_global_rank(cpu, r), group=cpu)
        states.append(box[0])
    return {"world_size": world, "states": states}


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


def _file(directory: str | os.PathLike, rank: int, world: int) -> Path:
    return Path(directory) / f"rank_{rank:05d}_of_{world:05d}.pt"


def _rank_world(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def failing_ranks(failed: bool, group=None) -> list[int]:
    """The ranks of ``group`` that report ``failed``, the same list on every rank (a small
    SUM allreduce over a CPU group; no collective with one process)."""
    rank, world = _rank_world(group)
    if world == 1:
        return [0] if failed else []
    flags = torch.zeros(world, dtype=torch.int32)
    flags[rank] = int(failed)
    dist.all_reduce(flags, group=cpu_group(group))
    return [r for r, f in enumerate(flags.tolist()) if f]


def together(what: str, call: Callable[[], Any], group=None) -> Any:
    """``call()`` on every rank of ``group``; a failure on any rank raises the same
    ``RuntimeError`` on every rank, naming the ranks (one small allreduce over a CPU group;
    none without a process group). For what one rank does alone (rank 0 writing a
    checkpoint, each rank reading one) before the next collective."""
    error: Exception | None = None
    result = None
    try:
        result = call()
    except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
        error = e
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        bad = failing_ranks(error is not None, group)
        if bad:
            here = f": {type(error).__name__}: {error}" if error is not None else "; see the error there"
            raise RuntimeError(f"lowbit: {what} failed on rank(s) {bad}{here}") from error
    elif error is not None:
        raise error
    return result


def save_files(obj: Any, directory: str | os.PathLike, group=None) -> dict[str, Any] | None:
    """Every rank writes its own ``obj`` (tensors copied to CPU) to a file of its own in
    ``directory``: the index ``{"world_size": P, "format": "files"}`` on rank 0, None on the
    others. Collective: call it on every rank. If any rank cannot write, every rank raises
    the same ``RuntimeError`` naming the ranks."""
    rank, world = _rank_world(group)
    error: Exception | None = None
    try:
        path = _file(directory, rank, world)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(to_cpu(obj), path)
    except Exception as e:  # noqa: BLE001 - reported on every rank below
        error = e
    bad = failing_ranks(error is not None, group)
    if bad:
        mine = f" (here: {type(error).__name__}: {error})" if error is not None else ""
        raise RuntimeError(
            f"lowbit: saving the rank-local state to {directory} failed on rank(s) {bad}{mine}; the checkpoint "
            "is incomplete: fix the storage (space, permissions, a directory every rank can write) and save again"
        ) from error
    return {"world_size": world, "format": "files"} if rank == 0 else None


def load_files(
    index: dict[str, Any],
    directory: str | os.PathLike,
    merge: Callable[[list], Any] | None,
    what: str,
    group=None,
) -> Any:
    """This rank's state from the files :func:`save_files` wrote (``index``: its return
    value): at the same world size this rank's own file; at another one ``merge`` of every
    saved rank's, with a warning (each rank then reads all of them).
    Collective: if a rank cannot see a file it needs, every rank raises the same
    ``FileNotFoundError`` naming the ranks and the directory."""
    rank, world = _rank_world(group)
    saved = int(index["world_size"])
    needed = [rank] if saved == world else list(range(saved))
    missing = [r for r in needed if not _file(directory, r, saved).is_file()]
    bad = failing_ranks(bool(missing), group)
    if bad:
        raise FileNotFoundError(
            f"lowbit: rank(s) {bad} cannot see the rank-local state in {directory} (written by {saved} ranks; "
            f"missing here: {[_file(directory, r, saved).name for r in missing] or 'none'}); resume from storage "
            "every rank can read, or copy each rank's file where it runs"
        )
    if saved == world:
        return torch.load(_file(directory, rank, saved), map_location="cpu", weights_only=True)
    return pick(
        {
            "world_size": saved,
            "states": [
                torch.load(_file(directory, r, saved), map_location="cpu", weights_only=True) for r in range(saved)
            ],
        },
        rank,
        world,
        merge,
        what,
    )


def remove_files(directory: str | os.PathLike, group=None) -> None:
    """Remove this rank's files from ``directory`` (every rank its own: no collective), and
    the directory once it is empty."""
    rank, world = _rank_world(group)
    for path in Path(directory).glob(f"rank_{rank:05d}_of_*.pt"):
        path.unlink(missing_ok=True)
    try:
        Path(directory).rmdir()
    except OSError:
        pass  # other ranks' files are still there (or it is gone already)


def mean_states(per_rank: Sequence[dict], what: str) -> dict:
    """One optimizer's ``state`` (``{index: {name: value}}``) saved by several ranks -> the state
    a rank of another world size loads: each floating-point tensor the mean over the ranks
    that hold it (rank-local momenta, whose consensus that is), every other value rank 0's.
    Tensors of different shapes (ranks holding different shards) raise, naming ``what``."""
    out: dict = {}
    for idx, values in per_rank[0].items():
        out[idx] = {}
        for name, value in values.items():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and all(idx in s for s in per_rank):
                if any(s[idx][name].shape != value.shape for s in per_rank):
                    raise ValueError(
                        f"{what} was saved by ranks holding different shards of the parameters: it cannot be "
                        "averaged into another world size; resume at the world size and sharding it was saved with"
                    )
                out[idx][name] = torch.stack([s[idx][name].float() for s in per_rank]).mean(0).to(value.dtype)
            else:
                out[idx][name] = value
    return out
