"""Run a function on P real processes joined in a gloo process group.

Workers assert inside themselves (each rank can rebuild every rank's input from a seed
and compute the single-process reference); an assertion error or exception in any rank
fails the test with that rank's traceback. Every run is bounded in time by the process
group's timeout.
"""
from __future__ import annotations

import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60


def _entry(rank: int, world_size: int, init_file: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=TIMEOUT_S),
    )
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    # Passed: leave without interpreter finalization, which costs a fraction of a second in
    # each of the suite's thousands of workers and checks nothing here. Orderly exit is
    # tested where users meet it: tests/docs/test_quickstart.py runs every front end's script
    # several times at once and requires exit code 0 (tests/collectives/test_chain.py, why).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world_size: int, fn, *args) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        mp.start_processes(
            _entry,
            args=(world_size, init_file, fn, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )


#: subgroups of a 4-rank world that one process group serves at once: P = 2, 3 and 4, with
#: ranks that are not 0..P-1 in the smaller ones
SUBGROUPS = ([1, 2], [0, 2, 3], [0, 1, 2, 3])


def in_subgroups(rank, world_size, check):
    """Run ``check(group_rank, P, group)`` on every subgroup of :data:`SUBGROUPS`."""
    groups = [dist.new_group(ranks) for ranks in SUBGROUPS]  # collective: all ranks, same order
    for ranks, group in zip(SUBGROUPS, groups):
        if rank in ranks:
            try:
                check(dist.get_rank(group), len(ranks), group)
            except AssertionError as e:
                raise AssertionError(f"P={len(ranks)} (global ranks {ranks}): {e}") from e
        dist.barrier()
