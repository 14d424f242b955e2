"""TurboQuantAdamW in one process and its communicator's pieces: AdamW bit for bit (warm-up
and, with nothing to send, the compression stage), validation, NaN safety, schedulers, the
form choice and the per-group RMS the scale EMA follows."""
import pytest
import torch

from lowbit_strategy import TurboQuantAdamW
from lowbit_strategy.algorithms.turboquant.communicator import choose_form, group_rms
from lowbit_strategy.codecs.hadamard import hadamard_rotate
from tests.algorithms.onebit.test_optimizer import _grads, _model

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.05


def _run(opt_cls, steps, dtype=torch.float32, **kw):
    params = list(_model().to(dtype).parameters())
    opt = opt_cls(params, **kw)
    for step in range(1, steps + 1):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g.to(dtype)
        opt.step()
    return params, opt


@pytest.mark.parametrize("warmup", [0, 3, 8])
def test_one_process_is_adamw_bit_for_bit(warmup):
    """Warm-up is AdamW; with nothing to send the compression stage is too (exact momentum,
    the variance from the gradient)."""
    ours, opt = _run(TurboQuantAdamW, 8, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, warmup_steps=warmup)
    ref, _ = _run(torch.optim.AdamW, 8, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert opt.global_step == 8 and opt.stage == ("warmup" if warmup > 8 else "compression")


def test_defaults_are_the_papers():
    opt = TurboQuantAdamW(_model().parameters())
    assert opt.defaults["lr"] == 5e-4 and opt.defaults["weight_decay"] == 0.01 and opt.defaults["betas"] == BETAS
    assert (opt.bits, opt.warmup_steps, opt.variance, opt.scale_decay) == (4, 200, "synchronized", 0.0)


def test_nan_step_is_skipped_in_both_stages():
    for warmup in (10, 1):
        params, opt = _run(TurboQuantAdamW, 3, lr=LR, warmup_steps=warmup)
        snapshot = [p.detach().clone() for p in params]
        states = {k: v.clone() for k, v in opt.state[params[0]].items()}
        for p in params:
            p.grad = torch.zeros_like(p)
        params[1].grad[0] = float("inf")
        with pytest.warns(RuntimeWarning, match="non-finite"):
            opt.step()
        assert opt.skipped_steps == 1 and opt.global_step == 3
        assert all(torch.equal(a, b) for a, b in zip(params, snapshot))
        assert all(torch.equal(opt.state[params[0]][k], v) for k, v in states.items())


def test_bf16_parameters():
    params, opt = _run(TurboQuantAdamW, 5, dtype=torch.bfloat16, lr=LR, warmup_steps=2)
    assert all(p.dtype == torch.bfloat16 and bool(torch.isfinite(p).all()) for p in params)
    assert all(opt.state[p]["exp_avg"].dtype == torch.bfloat16 for p in params)


@pytest.mark.parametrize("kwargs, match", [
    (dict(warmup_steps=-1), "warmup_steps must be an int >= 0"),
    (dict(warmup_steps=2.5), "warmup_steps"),
    (dict(bits=1), "bits must be an int in"),
    (dict(bits=True), "bits must be an int in"),
    (dict(variance="global"), "variance must be one of"),
    (dict(scale_decay=1.0), "scale_decay must be a number in"),
    (dict(lr=-1.0), "lr must be"),
    (dict(betas=(0.9,)), "betas must be a pair"),
    (dict(eps=0.0), "eps must be"),
    (dict(weight_decay=-0.1), "weight_decay"),
])
def test_bad_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TurboQuantAdamW(_model().parameters(), **kwargs)


def test_lr_scheduler_is_read_every_step():
    params, opt = _run(TurboQuantAdamW, 2, lr=LR, warmup_steps=1, weight_decay=0.0)
    before = [p.detach().clone() for p in params]
    for grp in opt.param_groups:
        grp["lr"] = 0.0
    for p, g in zip(params, _grads(3, params)):
        p.grad = g
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))


def test_state_dict_round_trip_resumes_bit_for_bit():
    straight, _ = _run(TurboQuantAdamW, 6, lr=LR, warmup_steps=2)
    half, opt = _run(TurboQuantAdamW, 3, lr=LR, warmup_steps=2)
    saved = opt.state_dict()
    params = list(_model().parameters())
    with torch.no_grad():
        for p, h in zip(params, half):
            p.copy_(h)
    resumed = TurboQuantAdamW(params, lr=LR, warmup_steps=2)
    resumed.load_state_dict(saved)
    for step in range(4, 7):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        resumed.step()
    assert all(torch.equal(a, b) for a, b in zip(params, straight))


def test_group_rms_is_the_rotated_groups_rms():
    """The scale EMA follows the RMS of each group before the rotation: the codec's scale
    groups (brute force), and equal up to rounding to the RMS of the rotated groups, because
    the blocked rotation is orthonormal on every group."""
    x = torch.randn(1000) * torch.linspace(0.1, 10, 1000)
    for padded, size in ((1000, 64), (1024, 256), (1000, 1024)):
        padded_x = torch.cat([x, x.new_zeros(padded - 1000)])
        got = group_rms(x, padded, size)
        assert got.numel() == -(-padded // size)
        brute = torch.stack([padded_x[i:i + size].pow(2).mean().sqrt() for i in range(0, padded, size)])
        torch.testing.assert_close(got, brute)
        y = hadamard_rotate(padded_x, seed=3, block=size)
        rotated = torch.stack([y[i:i + size].pow(2).mean().sqrt() for i in range(0, padded, size)])
        torch.testing.assert_close(got, rotated, rtol=1e-5, atol=1e-6)


def test_auto_form_follows_the_cost_model():
    # fat link, few ranks: the all-gather (one collective); many ranks: two stages (bytes)
    assert choose_form("auto", 2, 10**6, 50e-6, 1e9) == "allgather"
    assert choose_form("auto", 32, 10**6, 50e-6, 1e9) == "two_stage"
    assert choose_form("auto", 1, 10**6, 50e-6, 1e9) == "allgather"  # nothing sent: equal, the tie rule
    assert choose_form("two_stage", 2, 10, 50e-6, 1e9) == "two_stage"
    # tiny bucket on a high-latency link at P = 4: latency rules, the all-gather wins
    assert choose_form("auto", 4, 100, 1e-3, 1e9) == "allgather"
    # with the codec's measured time: a codec slower than the bytes it saves -> DDP's mean in
    # the fallback's wire, bf16 unless asked (bf16 sends 2(P-1)/P * 16 bits = 16 ns per element
    # at 1 Gbit/s, P = 2; fp32 32 ns)
    slow = {"allgather": 100e-9, "two_stage": 150e-9, "bf16": 0.4e-9, "fp32": 0.2e-9}
    assert choose_form("auto", 2, 10**6, 50e-6, 1e9, slow) == "bf16"
    assert choose_form("auto", 2, 10**6, 50e-6, 1e9, slow, fallback="fp32") == "fp32"
    # 100 Mbit/s: 160 ns of bf16 wire, 320 ns of fp32
    assert choose_form("auto", 2, 10**6, 50e-6, 1e8, slow) == "allgather"
    assert choose_form("auto", 2, 10**6, 50e-6, 1e8, {**slow, "allgather": 250e-9}) == "bf16"
    assert choose_form("auto", 2, 10**6, 50e-6, 1e8, {**slow, "allgather": 250e-9}, fallback="fp32") == "two_stage"
    assert choose_form("auto", 16, 10**6, 50e-6, 1e8, {**slow, "allgather": 900e-9}) == "two_stage"
    fast = {"allgather": 1e-12, "two_stage": 2e-12, "bf16": 1e-12, "fp32": 1e-12}  # a GPU codec
    assert choose_form("auto", 2, 10**6, 50e-6, 1e9, fast) == "allgather"
    assert choose_form("allgather", 2, 10**6, 50e-6, 1e9, slow) == "allgather"  # a set form is kept


@pytest.mark.parametrize("warmup", [0, 3])
def test_planned_exact_path_is_adamw_bit_for_bit(warmup):
    """Every bucket planned ``fp32`` on P > 1 (a stand-in communicator: the hook has averaged
    the gradients as DDP does): both stages are torch's AdamW (CPU default, the for-loop) bit
    for bit, run multi-tensor; the state keeps the two buffers under the keys it always had."""
    from types import SimpleNamespace

    def run(make):
        params = list(_model().parameters())
        opt = make(params)
        for step in range(1, 9):
            for p, g in zip(params, _grads(step, params)):
                p.grad = g
            opt.step()
        return params, opt

    def ours(params):
        opt = TurboQuantAdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, warmup_steps=warmup)
        opt.communicator = SimpleNamespace(world_size=4, exact=True)
        assert opt._distributed
        return opt

    mine, opt = run(ours)
    ref, _ = run(lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False))
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(mine, ref))
    assert opt.stage == "compression" and all(set(opt.state[p]) == {"exp_avg", "exp_avg_sq"} for p in mine)


def test_adamw_foreach_is_adamw_elementwise_bit_for_bit():
    """The multi-tensor AdamW (both stages' exact form) equals the single-tensor one the
    1-bit optimizers' warm-up uses, on several shapes and dtypes."""
    from lowbit_strategy.algorithms.staged import adam

    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (), (0, 2), (17,), (4, 4, 4)]
    dtypes = [torch.float32, torch.float32, torch.float32, torch.bfloat16, torch.float64]
    ps = [torch.randn(s, generator=gen).to(d) for s, d in zip(shapes, dtypes)]
    ms, vs = [torch.zeros_like(p) for p in ps], [torch.zeros_like(p) for p in ps]
    one = [[t.clone() for t in ts] for ts in (ps, ms, vs)]
    kw = dict(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD)
    for step in range(1, 5):
        gs = [torch.randn(p.shape, generator=gen).to(p.dtype) for p in ps]
        adam.adamw_foreach_(ps, gs, ms, vs, step=step, **kw)
        for p, m, v, g in zip(*one, gs):
            adam.adamw_(p, g, m, v, step=step, **kw)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for x, y in zip((ps, ms, vs), one) for a, b in zip(x, y))
