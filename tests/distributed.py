"""Run a function on P real processes joined in a gloo process group.

Workers assert inside themselves (each rank can rebuild every rank's input from a seed
and compute the single-process reference); an assertion error or exception in any rank
fails the test with that rank's traceback. Every run is bounded in time by the process
group's timeout.
"""
from __future__ import annotations

import os
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
