"""Lion and distributed Lion Cub against references computed from the same data."""
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowbit_strategy import LowBitConfig, Lion, LionCommunicator
from lowbit_strategy.codecs import lp_quantize_levels
from lowbit_strategy.collectives import group as g
from lowbit_strategy.algorithms.lion_cub.mode import SyncMode
from lowbit_strategy.collectives.summed import max_levels
from lowbit_strategy.algorithms.lion_cub import resolve_mode
from tests.distributed import run_ranks
from tests.training import batch as _batch
from tests.training import model as _model

STEPS = 6
LR, WD, BETAS = 0.01, 0.1, (0.9, 0.99)


def _grads(model, rank, step):
    model.zero_grad()
    x, y = _batch(rank, step)
    nn.functional.cross_entropy(model(x), y).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


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
            elif mode == "bf16":  # each rank's vector rounded to bf16 (at P = 2 the sum's rounding keeps its sign)
                d = torch.sign(sum(c.reshape(-1).bfloat16().float() for c in cs)).view_as(theta)
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


def _run_lion_cub(rank, world_size, mode, bits, p, momentum_sync_all=False, warmup=0, wire="bf16"):
    model = _model()
    opt = Lion(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    cfg = LowBitConfig(mode=mode, bits=bits, p=p, bucket_size_mb=0.0005, warmup_steps=warmup, warmup_wire=wire)
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
        assert opt.communicator.traffic.bytes_sent > 0
    # during warm-up the uncompressed sum in warmup_wire is synchronized, whatever the mode (bf16
    # checked at P = 2, where the wire's one rounding of the sum keeps its sign; at P > 2 gloo's
    # partial sums round too, in an order the reference cannot replay)
    for wire in ("bf16", "fp32") if world_size == 2 else ("fp32",):
        got, opt = _run_lion_cub(rank, world_size, "1bit", None, 1.0, warmup=STEPS, wire=wire)
        for a, b in zip(got, _reference_lion_cub(world_size, wire)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=wire)
        sent = {op for op in opt.communicator.traffic.by_op() if op.startswith("full.")}
        assert sent == {f"full.allreduce.{wire}"}, sent


def _check_fp32_equals_ddp(rank, world_size):
    got, _ = _run_lion_cub(rank, world_size, "fp32", None, 1.0, momentum_sync_all=True)
    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = Lion(ddp.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    for step in range(1, STEPS + 1):
        _grads(ddp, rank, step)
        opt.step()
    for a, b in zip(got, ddp.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-6)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``t`` (to compare replicas)."""
    p = dist.get_world_size()
    out = torch.empty(p * t.numel(), dtype=t.dtype)
    g.all_gather(out, t.reshape(-1).contiguous(), None, "test.gather")
    return list(out.view(p, *t.shape))


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
    assert opt.skipped_steps == 1 and opt.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    # the last layer has a gradient on rank 0 only: every rank updates it with the same
    # direction (none hangs), and the others' momentum follows a zero gradient
    grads = _grads(model, rank, 2)
    if rank != 0:
        model[-1].weight.grad = None
        model[-1].bias.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    head = model[-1].weight
    assert all(torch.equal(w, head.detach()) for w in _gather(head.detach()))
    assert not torch.equal(head.detach(), before[-2])
    want = (1 - opt.param_groups[0]["betas"][1]) * grads[-2] if rank == 0 else torch.zeros_like(head)
    torch.testing.assert_close(opt.state[head]["exp_avg"], want, rtol=0, atol=0)


def _check_whole_step_skip_and_global_step(rank, world_size):
    """Momentum sync counts the optimizer's steps even when group 0 is frozen (it has no
    gradient); a NaN in one group on one rank skips every group, counted once."""
    model = _model()
    frozen, live = list(model[0].parameters()), list(model[2].parameters()) + list(model[4].parameters())
    for t in frozen:
        t.requires_grad_(False)
    opt = Lion([{"params": frozen}, {"params": live}], lr=LR)
    comm = LionCommunicator(LowBitConfig(mode="sign"))
    opt.attach_communicator(comm)
    syncs = []
    average = comm.average_
    comm.average_ = lambda tensors: (syncs.append(opt.global_step), average(tensors))
    opt.set_momentum_sync(2, live)
    for step in range(1, 5):
        _grads(model, rank, step)
        opt.step()
        moms = _gather(opt.state[live[0]]["exp_avg"])
        # the ranks' momenta agree right after a sync step, and only then
        assert all(torch.equal(m, moms[0]) for m in moms) == (step % 2 == 0), step
    assert syncs == [2, 4] and opt.global_step == 4
    assert all(g["lion_step"] == 4 for g in opt.param_groups)
    # NaN in the second group on the last rank: both groups untouched, counted once
    for t in frozen:
        t.requires_grad_(True)
    _grads(model, rank, 5)
    if rank == world_size - 1:
        live[-1].grad[0] = float("inf")
    before = [t.detach().clone() for t in model.parameters()]
    moms = [opt.state[t]["exp_avg"].clone() for t in live]
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert opt.skipped_steps == 1 and opt.global_step == 4
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(m, opt.state[t]["exp_avg"]) for m, t in zip(moms, live))


class _WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _model()
        self.empty = nn.Parameter(torch.zeros(0))
        self.empty_rows = nn.Parameter(torch.zeros(0, 4))

    def forward(self, x):
        return self.net(x) + self.empty.sum() + self.empty_rows.sum()


def _check_zero_element_params(rank, world_size):
    for mode in ("1bit", "sign", "lp", "fp32", "bf16", "auto"):
        model = _WithEmpty()
        opt = Lion(model.parameters(), lr=LR)
        opt.attach_communicator(LionCommunicator(LowBitConfig(mode=mode)))
        opt.set_momentum_sync(1, model.parameters())
        for step in range(1, 3):
            model.zero_grad()
            x, y = _batch(rank, step)
            nn.functional.cross_entropy(model(x), y).backward()
            assert model.empty.grad is not None and model.empty.grad.numel() == 0
            opt.step()
        assert opt.global_step == 2, mode
        for t in model.net.parameters():
            assert all(torch.equal(w, t.detach()) for w in _gather(t.detach())), mode


def _run_ddp(rank, mode, bits, p, overlap, bucket_cap_mb=None):
    """Lion Cub through the plain-DDP front end: the DDP hook hands buckets to Lion (overlap)
    or keeps them for step()."""
    import lowbit_strategy

    kw = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = nn.parallel.DistributedDataParallel(_model(), **kw)
    opt = Lion(ddp.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    lowbit_strategy.attach(ddp, [opt], algorithm="lion", mode=mode, bits=bits, p=p, overlap=overlap)
    for step in range(1, STEPS + 1):
        ddp.zero_grad()
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [t.detach() for t in ddp.module.parameters()], opt


def _check_overlap(rank, world_size):
    """The overlapped path (collectives started from the DDP hook, several buckets) equals
    Algorithm 1 and the step-time path bit for bit, in every mode."""
    for mode, bits, p in [("1bit", None, 1.0), ("sign", None, 1.0), ("lp", 8, 1.0), ("fp32", None, 1.0)]:
        expected = _reference_lion_cub(world_size, mode, bits, p)
        got, opt = _run_ddp(rank, mode, bits, p, overlap=True, bucket_cap_mb=0.0005)
        step_path, _ = _run_ddp(rank, mode, bits, p, overlap=False)
        assert all(torch.equal(a, b) for a, b in zip(got, step_path)), mode
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=mode)
        ops = {r.op for r in opt.communicator.traffic.records}
        assert "lion.agree" not in ops, ops  # flags travel with the payloads
        assert opt.global_step == STEPS and opt.skipped_steps == 0
    # bf16 sums round in an order that depends on where an element falls in the ring's
    # chunks (so on the bucket layout): no bit-exact reference, but every replica agrees
    got, opt = _run_ddp(rank, "bf16", None, 1.0, overlap=True, bucket_cap_mb=0.0005)
    assert opt.global_step == STEPS and all(bool(torch.isfinite(t).all()) for t in got)
    for t in got:
        assert all(torch.equal(w, t) for w in _gather(t))


def _check_overlap_nonfinite(rank, world_size):
    """An Inf on one rank in the bucket the hook sees skips the step on every rank, in every
    mode (the flag travels with the payload); weights stay equal across ranks."""
    for mode in ("1bit", "sign", "lp", "fp32"):
        model = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=0.0005)
        opt = Lion(model.parameters(), lr=LR)
        import lowbit_strategy

        lowbit_strategy.attach(model, [opt], algorithm="lion", mode=mode)
        for step in range(1, 4):
            model.zero_grad()
            x, y = _batch(rank, step)
            if step == 2 and rank == world_size - 1:
                x = x.clone()
                model.module[0].weight.data[x[0, 0]] *= float("inf")  # Inf activations -> NaN/Inf grads
            out = model(x)
            nn.functional.cross_entropy(out, y).backward()
            if step == 2 and rank == world_size - 1:
                model.module[0].weight.data.nan_to_num_(0.0, 0.0, 0.0)
            before = [t.detach().clone() for t in model.parameters()]
            if step == 2:
                with pytest.warns(RuntimeWarning, match="non-finite"):
                    opt.step()
                assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), mode
            else:
                opt.step()
        assert opt.skipped_steps == 1 and opt.global_step == 2, mode


def _check_channels_last(rank, world_size):
    """A channels_last weight: DDP lays its bucket out in the weight's strides; the overlapped
    path must read the gradient in the parameter's own layout (same result as step time)."""
    import lowbit_strategy

    results = []
    for overlap in (True, False):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))
        net = net.to(memory_format=torch.channels_last)
        assert net[0].weight.is_contiguous(memory_format=torch.channels_last)
        ddp = nn.parallel.DistributedDataParallel(net)
        opt = Lion(ddp.parameters(), lr=LR)
        lowbit_strategy.attach(ddp, [opt], algorithm="lion", mode="sign", overlap=overlap)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randn(2, 3, 6, 6, generator=gen).to(memory_format=torch.channels_last)
            ddp.zero_grad()
            ddp(x).square().sum().backward()
            opt.step()
        results.append([t.detach().clone() for t in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


def _check_all(rank, world_size):
    """Every multi-process Lion check of one world size, in one process group."""
    _check_modes(rank, world_size)
    if world_size <= 3:
        _check_fp32_equals_ddp(rank, world_size)
    if world_size == 3:
        _check_nonfinite_and_unused(rank, world_size)
    _check_whole_step_skip_and_global_step(rank, world_size)
    _check_zero_element_params(rank, world_size)
    _check_overlap(rank, world_size)
    _check_overlap_nonfinite(rank, world_size)
    _check_channels_last(rank, world_size)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_distributed_lion_cub(world_size):
    """P = 2, 3, 4: the compressed modes match Algorithm 1 computed in one process; at 32 bits
    with full momentum sync it equals DDP + Lion; a NaN on one rank skips the whole step on
    every rank; unused parameters stay consistent; momentum sync counts global steps;
    zero-element parameters work in every mode."""
    run_ranks(world_size, _check_all)


def _check_world_of_one(rank, world_size):
    _check_zero_element_params(rank, world_size)
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
        assert cub.communicator.traffic.bytes_sent == 0


@pytest.mark.slow
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
    # the momentum-sync interval the optimizer really uses counts, not only the config's
    assert resolve_mode(slow, 4, 10**7, momentum_sync_every=10).mode == "1bit"


def test_auto_counts_measured_codec_time_and_never_plans_slower_than_bf16():
    from lowbit_strategy.algorithms.lion_cub.mode import auto_candidates, measure_codec_seconds

    fast = LowBitConfig(link_bandwidth_gbps=10, link_latency_us=5)
    n = 10**7
    # the uncompressed fallback is warmup_wire's: bf16 (what DDP's bf16 hook sends) unless asked
    assert auto_candidates(fast, 4) == ("lp8", "bf16") and auto_candidates(fast, 4, 10)[-1] == "bf16"
    assert auto_candidates(fast.replace(warmup_wire="fp32"), 4) == ("lp8", "fp32")
    measured = measure_codec_seconds(auto_candidates(fast, 4, 10), 4, n, 1.0, sample=1 << 16, repeat=1)
    assert set(measured) == {"lp8", "sign", "1bit", "bf16"} and all(t > 0 for t in measured.values())
    # bf16 is timed as its cast, not as a 16-bit code lane (which costs what lp8 costs: two near
    # equal codec times made auto's choice a coin toss between runs)
    import lowbit_strategy.algorithms.lion_cub.mode as mode_module

    quantized = []
    real_quantize = mode_module.lp_quantize_levels
    mode_module.lp_quantize_levels = lambda *a, **k: quantized.append(a[1]) or real_quantize(*a, **k)
    try:
        measure_codec_seconds(("bf16", "fp32"), 4, 4096, 1.0, sample=4096, repeat=1)
        assert quantized == []
        measure_codec_seconds(("lp8",), 4, 4096, 1.0, sample=4096, repeat=1)
        assert quantized and set(quantized) == {max_levels(4, 8)}
    finally:
        mode_module.lp_quantize_levels = real_quantize
    # a codec slower than the bytes it saves: bf16 (what DDP's bf16 hook sends) wins ...
    slow_codec = {"lp8": 1.0, "bf16": 0.001, "fp32": 0.001}
    assert resolve_mode(fast, 4, n, slow_codec) == SyncMode("bf16", 16)
    assert resolve_mode(fast.replace(warmup_wire="fp32"), 4, n, slow_codec) == SyncMode("fp32", 32)
    # ... but not on a slow link, where the wire dominates; without timings only bytes count
    assert resolve_mode(fast.replace(link_bandwidth_gbps=0.01), 4, n, slow_codec).mode == "lp"
    assert resolve_mode(fast, 4, n).mode == "lp"
