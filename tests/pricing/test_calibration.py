"""The codec timings ``auto`` plans agree on (lowbit_strategy.pricing.calibration):
every rank measures after a barrier, and every rank keeps the slowest rank's figures."""

import time

import pytest
import torch
import torch.distributed as dist

from lowbit_strategy.collectives import wire
from lowbit_strategy.pricing import calibration
from lowbit_strategy.pricing.calibration import agreed_slowest, median_seconds
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


def test_auto_plans_measure_without_touching_the_global_rng():
    """A measurement that drew from torch's global RNG made ``auto`` change the training: every
    later draw from it (dropout, a RandomSampler without a generator) differed from a run with
    the plan ``auto`` chose, pinned. Each measurement draws from a private generator."""
    from lowbit_strategy.algorithms.lion_cub import mode as lion_plan
    from lowbit_strategy.algorithms.turboquant import form as tq_plan
    from lowbit_strategy.codecs import TurboQuantCodec

    torch.manual_seed(7)
    before = torch.get_rng_state()
    lion_plan.measure_codec_seconds(("lp8", "1bit"), 4, 4096, 1.0, "cpu", 4096, 1)
    tq_plan.measure_codec_seconds(TurboQuantCodec(4, seed=0, block=1024), 4, "cpu", 4096, 1)
    assert torch.equal(torch.get_rng_state(), before)
    a, b = calibration.sample_values(3, 5), calibration.sample_values(3, 5)
    assert a.shape == (3, 5) and torch.equal(a, b)  # seeded: every rank times the same values
    assert torch.equal(torch.get_rng_state(), before)
