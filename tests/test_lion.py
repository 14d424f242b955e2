"""Lion and distributed Lion Cub against references computed from the same data."""
import math
import warnings

import pytest
import torch
from torch import nn

from lowbit_strategy import LowBitConfig, Lion, LionCommunicator
from lowbit_strategy.codecs import lp_quantize_levels
from lowbit_strategy.collectives.summed import max_levels
from lowbit_strategy.optim.communicator import resolve_mode
from tests.distributed import run_ranks

STEPS = 6
LR, WD, BETAS = 0.01, 0.1, (0.9, 0.99)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 5))


def _batch(rank, step):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 20, (4, 3), generator=gen), torch.randint(0, 5, (4,), generator=gen)


def _grads(model, rank, step):
    model.zero_grad()
    x, y = _batch(rank, step)
    nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


def _reference_lion_cub(world_size, mode, bits=None, p=1.0):
    """Lion Cub Algorithm 1 in one process: every rank's momentum, the mode's aggregation."""
    models = [_model() for _ in range(world_size)]
    params = [list(m.parameters()) for m in models]
    moms = [[torch.zeros_like(t) for t in params[0]] for _ in range(world_size)]
    b1, b2 = BETAS
    levels = max_levels(world_size, bits or 8) if mode == "lp" else 0
    for step in range(1, STEPS + 1):
        grads = [_grads(models[r], r, step) for r in range(world_size)]
        for k, theta in enumerate(params[0]):
            cs = [moms[r][k] * b1 for r in range(world_size)]
            for r in range(world_size):
                cs[r].add_(grads[r][k], alpha=1 - b1)
            if mode == "fp32":
                d = torch.sign(sum(c.reshape(-1) for c in cs)).view_as(theta)
            elif mode in ("1bit", "sign"):
                tie_up = step % 2 == 1
                ups = sum(((c > 0) | ((c == 0) & tie_up)).int() for c in cs)
                d = torch.sign(2 * ups - world_size).float()
                if mode == "1bit":
                    d = torch.where(d == 0, torch.tensor(1.0 if tie_up else -1.0), d)
            else:  # lp: per-parameter L_p codes, summed exactly
                d = torch.sign(sum(lp_quantize_levels(c.reshape(-1), levels, p).int() for c in cs)).float().view_as(theta)
            for r in range(world_size):
                with torch.no_grad():
                    params[r][k].mul_(1 - LR * WD).add_(d, alpha=-LR)
                moms[r][k].mul_(b2).add_(grads[r][k], alpha=1 - b2)
    return [t.detach() for t in params[0]]


def _run_lion_cub(rank, world_size, mode, bits, p, momentum_sync_all=False, warmup=0):
    model = _model()
    opt = Lion(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    cfg = LowBitConfig(mode=mode, bits=bits, p=p, bucket_size_mb=0.0005, warmup_steps=warmup)
    opt.attach_communicator(LionCommunicator(cfg))
    if momentum_sync_all:
        opt.set_momentum_sync(1, model.parameters())
    for step in range(1, STEPS + 1):
        _grads(model, rank, step)
        opt.step()
    return [t.detach() for t in model.parameters()], opt


def _check_modes(rank, world_size):
    for mode, bits, p in [("1bit", None, 1.0), ("sign", None, 1.0), ("sign", 8, 1.0), ("lp", 8, 1.0),
                          ("lp", 16, 0.0), ("lp", 8, math.inf), ("fp32", None, 1.0)]:
        got, opt = _run_lion_cub(rank, world_size, mode, bits, p)
        expected = _reference_lion_cub(world_size, mode, bits, p)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"{mode} {bits} {p}")
        assert opt.communicator.log.bytes_sent > 0
    # during warm-up the exact fp32 sum is synchronized, whatever the mode
    got, _ = _run_lion_cub(rank, world_size, "1bit", None, 1.0, warmup=STEPS)
    for a, b in zip(got, _reference_lion_cub(world_size, "fp32")):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def _check_fp32_equals_ddp(rank, world_size):
    got, _ = _run_lion_cub(rank, world_size, "fp32", None, 1.0, momentum_sync_all=True)
    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = Lion(ddp.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    for step in range(1, STEPS + 1):
        _grads(ddp, rank, step)
        opt.step()
    for a, b in zip(got, ddp.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-6)


def _check_nonfinite_and_unused(rank, world_size):
    model = _model()
    opt = Lion(model.parameters(), lr=LR)
    opt.attach_communicator(LionCommunicator(LowBitConfig(mode="1bit")))
    _grads(model, rank, 1)
    if rank == world_size - 1:
        model[0].weight.grad[0, 0] = float("nan")
    before = [t.detach().clone() for t in model.parameters()]
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # the last layer has a gradient on rank 0 only: every rank updates it, none hangs
    _grads(model, rank, 2)
    if rank != 0:
        model[-1].weight.grad = None
        model[-1].bias.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert "exp_avg" in opt.state[model[-1].weight]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_compressed_modes_match_algorithm_1(world_size):
    run_ranks(world_size, _check_modes)


@pytest.mark.parametrize("world_size", [2, 3])
def test_fp32_with_full_momentum_sync_equals_ddp_lion(world_size):
    run_ranks(world_size, _check_fp32_equals_ddp)


def test_nonfinite_skips_on_all_ranks_and_unused_params_stay_consistent():
    run_ranks(3, _check_nonfinite_and_unused)


def _check_world_of_one(rank, world_size):
    for mode in ("1bit", "sign", "lp", "fp32", "auto"):
        a, b = _model(), _model()
        plain = Lion(a.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
        cub = Lion(b.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
        cub.attach_communicator(LionCommunicator(LowBitConfig(mode=mode)))
        for step in range(1, STEPS + 1):
            _grads(a, 0, step)
            _grads(b, 0, step)
            plain.step()
            cub.step()
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters())), mode
        assert cub.communicator.log.bytes_sent == 0


def test_world_size_one_is_plain_lion_bit_for_bit():
    run_ranks(1, _check_world_of_one)


def test_plain_lion_matches_the_update_rule_and_reads_lr_each_step():
    model = _model()
    opt = Lion(model.parameters(), lr=0.1, betas=BETAS, weight_decay=WD)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref = [t.detach().clone() for t in model.parameters()]
    moms = [torch.zeros_like(t) for t in ref]
    for step in range(1, 4):
        lr = opt.param_groups[0]["lr"]
        grads = _grads(model, 0, step)
        opt.step()
        sched.step()
        for k in range(len(ref)):
            c = moms[k] * BETAS[0] + (1 - BETAS[0]) * grads[k]
            ref[k] = ref[k] * (1 - lr * WD) - lr * torch.sign(c)
            moms[k] = moms[k] * BETAS[1] + (1 - BETAS[1]) * grads[k]
    for a, b in zip(model.parameters(), ref):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=1e-7)


def test_plain_lion_skips_nonfinite_steps():
    model = _model()
    opt = Lion(model.parameters(), lr=0.1)
    _grads(model, 0, 1)
    model[-1].bias.grad[0] = float("inf")
    before = [t.detach().clone() for t in model.parameters()]
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("kwargs,match", [
    ({"lr": -1}, "lr must be"), ({"betas": (1.0, 0.9)}, r"betas\[0\]"), ({"betas": (0.9,)}, "pair"),
    ({"weight_decay": -0.1}, "weight_decay"),
])
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Lion(_model().parameters(), **kwargs)


def test_auto_mode_keeps_quality_and_follows_the_link():
    slow = LowBitConfig(link_bandwidth_gbps=0.1, link_latency_us=50)
    fast = LowBitConfig(link_bandwidth_gbps=100, link_latency_us=500)
    # without momentum sync only L1 codes are eligible: the lane holding >= 7 levels per rank
    plan = resolve_mode(slow, 4, 10**7)
    assert (plan.mode, plan.bits, plan.levels) == ("lp", 8, 31)
    assert resolve_mode(fast, 64, 10**5).bits == 16  # 8-bit lanes leave < 7 levels at P=64
    # with momentum sync the cost model may trade down: 1-bit when bandwidth-bound ...
    assert resolve_mode(slow.replace(momentum_sync_every=10), 4, 10**7).mode == "1bit"
    # ... and the lane allreduce's log P rounds when latency-bound at scale
    assert resolve_mode(fast.replace(momentum_sync_every=10), 64, 10**3).mode == "sign"
    assert resolve_mode(LowBitConfig(mode="sign"), 16, 10).bits == 8
    with pytest.raises(OverflowError, match="wider lane"):
        resolve_mode(LowBitConfig(mode="lp", bits=8), 200, 10)
