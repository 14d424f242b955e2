"""A peer that dies mid-collective: the survivor's wait ends with an error naming the
collective it was waiting for and where the timeout is set, not a hang and not a bare gloo
message (2 gloo processes; rank 1 exits while rank 0 waits)."""

import json
import os
import sys
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60


def _worker(rank, world, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S))
    from lowbit_strategy.collectives import group as g

    dist.barrier()
    if rank == 1:
        time.sleep(0.5)
        sys.stdout.flush()
        os._exit(7)  # dies without ever joining the collective rank 0 waits for
    start = time.monotonic()
    result = {"raised": None}
    try:
        buf = torch.empty(2 * world)
        g.all_gather_async(buf, torch.ones(2), None, "probe.codes", None).wait()
    except Exception as e:  # noqa: BLE001 - what the test checks
        result = {"raised": type(e).__name__, "message": str(e), "seconds": time.monotonic() - start}
    with open(out, "w") as f:
        json.dump(result, f)
    os._exit(0)


@pytest.mark.slow
def test_a_dead_peer_ends_the_survivor_with_the_collectives_name():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        ctx = mp.start_processes(_worker, args=(2, os.path.join(tmp, "store"), out), nprocs=2, join=False,
                                 start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S + 60
        while not all(p.exitcode is not None for p in ctx.processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        for p in ctx.processes:
            if p.exitcode is None:
                p.kill()
        assert [p.exitcode for p in ctx.processes] == [0, 7]
        with open(out) as f:
            result = json.load(f)
    # (a future's callback error reaches wait() wrapped in a RuntimeError that quotes it)
    assert "CollectiveError" in result["raised"] + result["message"], result
    assert "'probe.codes'" in result["message"] and "peer rank has probably died" in result["message"]
    assert "init_process_group(timeout=" in result["message"]
    assert result["seconds"] < TIMEOUT_S + 5, result
