"""The codec timings ``auto`` plans agree on (lowbit_strategy.collectives.calibration):
every rank measures after a barrier, and every rank keeps the slowest rank's figures."""

import time

import pytest
import torch.distributed as dist

from lowbit_strategy.collectives import calibration, wire
from lowbit_strategy.collectives.calibration import agreed_slowest, median_seconds
from tests.distributed import run_ranks


def test_median_seconds_is_the_median_after_a_warm_up(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])
    durations = iter([5.0, 0.03, 0.0, 0.01])  # a slow warm-up, then three timed calls

    def fn():
        clock[0] += next(durations)

    assert median_seconds(fn, repeat=3) == pytest.approx(0.01)  # the warm-up is not counted
    with pytest.raises(StopIteration):
        fn()  # (each call ran once)


def _check(rank, world_size):
    late = 1  # this rank arrives 0.3 s after the others: nobody measures before it is there
    if rank == late:
        time.sleep(0.3)
    arrived = time.time()
    began = []

    def measure():
        began.append(time.time())
        return {"encode": float(rank + 1), "decode": 10.0 - rank}

    traffic = wire.TrafficLog()
    agreed = agreed_slowest(measure, None, "test.calibrate", traffic)
    assert agreed == {"encode": float(world_size), "decode": 10.0}  # each key's slowest rank
    assert [r.op for r in traffic.records] == ["test.calibrate.start", "test.calibrate"]
    times = [None] * world_size
    dist.all_gather_object(times, (arrived, began[0]))
    assert min(b for _, b in times) >= max(a for a, _ in times), times  # (one host: one clock)


@pytest.mark.slow
def test_every_rank_measures_at_once_and_keeps_the_slowest():
    run_ranks(3, _check)
