"""The int2 warm-up's pieces on one process (:mod:`lowbit_strategy.algorithms.staged.warmup_codes`);
against DDP + BitDP's hook + AdamW on real process groups: tests/algorithms/onebit/test_distributed.py
(flat), tests/collectives/test_hierarchy.py (across nodes), tests/integrations/test_sharded.py (FSDP2)."""
import pytest
import torch
from torch import nn

from lowbit_strategy import LowBitConfig
from lowbit_strategy.algorithms.staged.warmup_codes import CODED_STEPS_FROM, CodedWarmup, _Bucket
from lowbit_strategy.collectives.wire import TrafficLog
from tests.distributed import run_ranks


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def test_a_ddp_bucket_splits_as_bitdp_splits_it():
    """DDP's layout (each gradient at the running offset) read as BitDP reads a GradBucket:
    the linear weights quantized, every other parameter in one full-precision run each."""
    net = _net()
    coded = CodedWarmup(LowBitConfig(algorithm="onebit_adam", warmup_wire="int2"), net, TrafficLog(), TrafficLog())
    params = list(reversed(list(net.parameters())))  # DDP's order: last parameter first
    flat = torch.arange(sum(p.numel() for p in params), dtype=torch.float32)
    bucket = _Bucket(0, flat, params)
    views = bucket.gradients()
    assert [v.shape for v in views] == [p.shape for p in params]
    assert torch.equal(torch.cat([v.reshape(-1) for v in views]), flat)
    plan = coded.state.plan(bucket)
    assert [shape for _, shape, _ in plan.quantized] == [(3, 6), (6, 4)]
    assert sum(n for _, n in plan.full) == flat.numel() - 18 - 24
    assert (coded.state.bits, coded.state.error_feedback, coded.state.full_wire) == (2, True, "bf16")
    assert coded.state.start_iter == CODED_STEPS_FROM - 1 == 2  # the first two steps in bf16


def test_its_residuals_go_when_the_warmup_ends_and_round_trip_by_name():
    net = _net()
    coded = CodedWarmup(LowBitConfig(algorithm="onebit_adam", warmup_wire="int2"), net, TrafficLog(), TrafficLog())
    weight = net[1].weight
    coded.state.residuals[id(weight)] = torch.full_like(weight, 0.25)
    saved = coded.state_dict()
    assert set(saved["residuals"]) == {"1.weight"}
    other = CodedWarmup(LowBitConfig(algorithm="onebit_adam", warmup_wire="int2"), net, TrafficLog(), TrafficLog())
    other.load_state_dict(saved)
    assert torch.equal(other.state.residuals[id(weight)], torch.full_like(weight, 0.25))
    coded.end()
    assert not coded.state.residuals and not coded.state.server_errors


def _one_rank(rank, world_size):
    """One worker: nothing crosses, so nothing is coded: the warm-up is AdamW on the gradient."""
    from lowbit_strategy import OneBitAdam
    from tests.training import loss, model, train

    cfg = LowBitConfig(algorithm="onebit_adam", warmup_wire="int2")
    ours, _, sync = train(rank, lambda ps: OneBitAdam(ps, lr=1e-2, weight_decay=0.01, freeze_step=4), cfg, 4)
    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    for step in range(1, 5):
        opt.zero_grad()
        loss(ref, rank, step).backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours.module.parameters(), ref.parameters()))
    assert sum(log.bytes_sent for log in sync.traffic_logs()) == 0


@pytest.mark.slow
def test_one_worker_codes_nothing():
    run_ranks(1, _one_rank)
