"""OneBitAdam / OneBitLamb in one process: the warm-up against torch.optim.AdamW and a
plainly written LAMB, the compression stage against a plainly written Algorithm 1 without
communication, the switch, validation and NaN safety."""
import copy
import math

import pytest
import torch
from torch import nn

from lowbit_strategy import OneBitAdam, OneBitLamb

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.05


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _grads(step: int, params) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen) * (1 + i) for i, p in enumerate(params)]


def _run(opt_cls, steps, **kw):
    model = _model()
    params = list(model.parameters())
    opt = opt_cls(params, **kw)
    for step in range(1, steps + 1):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g
        opt.step()
    return params, opt


def test_onebit_adam_warmup_is_adamw_bit_for_bit():
    ours, opt = _run(OneBitAdam, 6, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=6)
    ref, _ = _run(torch.optim.AdamW, 6, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    assert opt.global_step == 6 and opt.stage == "compression"


def test_warmup_runs_multi_tensor_unless_a_subclass_brings_its_own(monkeypatch):
    """The staged base batches its AdamW warm-up (``adamw_foreach_``); a subclass that
    overrides ``_warmup`` alone still gets it called on every parameter."""
    from lowbit_strategy.algorithms.staged import adam

    batched = []
    real = adam.adamw_foreach_
    monkeypatch.setattr(adam, "adamw_foreach_", lambda ps, *a, **k: batched.append(len(ps)) or real(ps, *a, **k))
    _run(OneBitAdam, 2, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=6)
    assert batched and all(n > 1 for n in batched)

    seen = []

    class Own(OneBitAdam):
        def _warmup(self, group, p, grad, step):
            seen.append(step)
            super()._warmup(group, p, grad, step)

    batched.clear()
    ours, _ = _run(Own, 2, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=6)
    ref, _ = _run(torch.optim.AdamW, 2, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, foreach=False)
    assert set(batched) == {1} and len(seen) == len(batched) == 2 * len(ours)  # per parameter, every step
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def _reference_adam(steps, freeze, clip=None):
    """Algorithm 1 of 1-bit Adam in one process, written out: AdamW, then frozen variance;
    ``clip``: the compression stage's m̂ / (sqrt(v̂) + eps) clamped to [-clip, clip]."""
    params = [p.detach().clone() for p in _model().parameters()]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    b1, b2 = BETAS
    for t in range(1, steps + 1):
        for i, g in enumerate(_grads(t, params)):
            params[i] = params[i] * (1 - LR * WD)
            m[i] = b1 * m[i] + (1 - b1) * g
            if t <= freeze:
                v[i] = b2 * v[i] + (1 - b2) * g * g
            vt = freeze if t > freeze else t
            m_hat = m[i] / (1 - b1 ** t)
            v_hat = v[i] / (1 - b2 ** vt)
            direction = m_hat / (v_hat.sqrt() + EPS)
            if clip is not None and t > freeze:
                direction = direction.clamp(-clip, clip)
            params[i] = params[i] - LR * direction
    return params


@pytest.mark.parametrize("clip", [None, 0.5])  # None: the paper's form; 0.5 binds on these gradients
def test_onebit_adam_single_process_compression_stage(clip):
    ours, opt = _run(OneBitAdam, 9, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=4, update_clip=clip)
    reference = _reference_adam(9, 4, clip)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a.detach(), b, rtol=1e-5, atol=1e-6)
    if clip is not None:  # the bound changed something here
        assert any(not torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(reference, _reference_adam(9, 4)))
    # the variance stopped moving at the switch
    frozen = [opt.state[p]["exp_avg_sq"].clone() for p in ours]
    for p, g in zip(ours, _grads(50, ours)):
        p.grad = g * 100
    opt.step()
    assert all(torch.equal(opt.state[p]["exp_avg_sq"], f) for p, f in zip(ours, frozen))


def _reference_lamb(steps, freeze, min_coeff=0.01, max_coeff=10.0, beta3=0.9, fmin=0.5, fmax=4.0, thr=0.1, clip=None):
    """LAMB (bias-corrected, whole-ratio clip) then 1-bit LAMB's compression stage in one
    process (exact momentum), written out per parameter with Python scalars; ``clip``: the
    compression stage's m̂ / (sqrt(v̂_frozen) + eps) clamped to [-clip, clip]."""
    params = [p.detach().clone().double() for p in _model().parameters()]
    n = len(params)
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    c_avg = [0.0] * n
    b1, b2 = BETAS
    fresh, c_frozen, last, scale = [None] * n, [None] * n, [1.0] * n, [1.0] * n
    for t in range(1, steps + 1):
        grads = [g.double() for g in _grads(t, params)]
        for i, g in enumerate(grads):
            m_prev = m[i]
            m_local = b1 * m[i] + (1 - b1) * g
            if t <= freeze:
                m[i] = m_local
                v[i] = b2 * v[i] + (1 - b2) * g * g
                u = (m[i] / (1 - b1 ** t)) / ((v[i] / (1 - b2 ** t)).sqrt() + EPS) + WD * params[i]
                wn, un = params[i].norm().item(), u.norm().item()
                c = min(max(wn / un, min_coeff), max_coeff) if wn > 0 and un > 0 else min(max(1.0, min_coeff), max_coeff)
                c_avg[i] = beta3 * c_avg[i] + (1 - beta3) * c
                params[i] = params[i] - LR * c * u
            else:
                # momentum scaled and unscaled around the (here exact) allreduce: a no-op up to rounding
                m[i] = (m_local * scale[i]) / scale[i]
                g_rec = (m[i] - b1 * m_prev) / (1 - b1)
                fresh[i] = b2 * fresh[i] + (1 - b2) * g_rec * g_rec
                den_frozen = (v[i] / (1 - b2 ** freeze)).sqrt() + EPS
                den_fresh = (fresh[i] / (1 - b2 ** t)).sqrt() + EPS
                r = (den_frozen / den_fresh).max().item()
                r = min(max(r, last[i] * (1 - thr)), last[i] * (1 + thr))
                r = min(max(r, fmin), fmax)
                last[i] = r
                adam_part = (m[i] / (1 - b1 ** t)) / den_frozen
                u = (adam_part if clip is None else adam_part.clamp(-clip, clip)) + WD * params[i]
                params[i] = params[i] - LR * r * c_frozen[i] * u
        if t == freeze:
            rms = [mi.norm().item() / math.sqrt(mi.numel()) for mi in m]
            united = sum(rms) / n
            for i in range(n):
                fresh[i] = v[i].clone()
                c_frozen[i] = c_avg[i] / (1 - beta3 ** freeze)
                scale[i] = united / rms[i]
    return params


@pytest.mark.parametrize("clip", [None, 0.5])  # None: the paper's form; 0.5 binds on these gradients
def test_onebit_lamb_against_reference_lamb_both_stages(clip):
    ours, opt = _run(OneBitLamb, 10, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=5, update_clip=clip)
    reference = _reference_lamb(10, 5, clip=clip)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a.detach().double(), b, rtol=1e-5, atol=1e-6)
    if clip is not None:
        assert any(not torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(reference, _reference_lamb(10, 5)))
    state = opt.state[ours[0]]
    assert {"exp_avg_sq_fresh", "lamb_coeff_freeze", "last_factor", "scaling_coeff"} <= set(state)
    assert 0.5 <= float(state["last_factor"]) <= 4.0


def test_ratio_clips_in_the_papers_order():
    from lowbit_strategy.algorithms.onebit.lamb import clip_ratio

    last = torch.tensor(3.9)
    # rate clip first (3.9 * 1.1 = 4.29), then the hard bound 4.0
    assert float(clip_ratio(torch.tensor(10.0), last, factor_min=0.5, factor_max=4.0, factor_threshold=0.1)) == 4.0
    assert float(clip_ratio(torch.tensor(0.1), torch.tensor(1.0), factor_min=0.5, factor_max=4.0,
                            factor_threshold=0.1)) == pytest.approx(0.9)


def test_never_seen_coordinates_get_no_update_after_the_switch():
    emb = nn.Embedding(5, 3)
    opt = OneBitAdam(emb.parameters(), lr=0.1, freeze_step=2)
    before = emb.weight.detach().clone()
    for _ in range(4):
        opt.zero_grad()
        emb(torch.tensor([0, 1])).sum().backward()  # rows 2..4 never get a gradient
        opt.step()
    assert torch.equal(emb.weight[2:], before[2:])
    assert not torch.equal(emb.weight[:2], before[:2])


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLamb])
def test_nan_step_is_skipped(cls):
    params, opt = _run(cls, 3, lr=LR, freeze_step=2)
    snapshot = [p.detach().clone() for p in params]
    states = {k: v.clone() for k, v in opt.state[params[0]].items() if isinstance(v, torch.Tensor)}
    for p in params:
        p.grad = torch.zeros_like(p)
    params[1].grad[0] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.step()
    assert opt.skipped_steps == 1 and opt.global_step == 3
    assert all(torch.equal(a, b) for a, b in zip(params, snapshot))
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in states.items())


@pytest.mark.parametrize("kwargs, match", [
    (dict(freeze_step=0), "freeze_step must be a positive int"),
    (dict(freeze_step=2.5), "freeze_step"),
    (dict(lr=-1.0), "lr must be"),
    (dict(betas=(0.9,)), "betas must be a pair"),
    (dict(betas=(1.0, 0.9)), r"betas\[0\]"),
    (dict(eps=0.0), "eps must be"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(update_clip="fast"), "update_clip must be 'auto'"),
    (dict(update_clip=0.0), "update_clip must be a number"),
    (dict(update_clip=True), "update_clip must be a number"),
    (dict(guard=1.0), "guard must be a number"),
    (dict(guard="auto"), "guard must be a number"),
])
def test_bad_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OneBitAdam(_model().parameters(), **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(min_coeff=1.0, max_coeff=0.5), "max_coeff"),
    (dict(factor_min=2.0, factor_max=1.0), "factor_max"),
    (dict(factor_threshold=1.5), "factor_threshold"),
    (dict(coeff_beta=1.0), "coeff_beta"),
])
def test_bad_lamb_arguments_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        OneBitLamb(_model().parameters(), **kwargs)


def test_lr_scheduler_is_read_every_step():
    params, opt = _run(OneBitAdam, 1, lr=LR, freeze_step=1)
    before = [p.detach().clone() for p in params]
    for grp in opt.param_groups:
        grp["lr"] = 0.0
    for p, g in zip(params, _grads(2, params)):
        p.grad = g
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))  # wd 0, lr 0: nothing moves


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLamb])
def test_bf16_parameters_through_both_stages(cls):
    model = _model().to(torch.bfloat16)
    params = list(model.parameters())
    opt = cls(params, lr=LR, freeze_step=2)
    before = [p.detach().clone() for p in params]
    for step in range(1, 6):
        for p, g in zip(params, _grads(step, params)):
            p.grad = g.to(torch.bfloat16)
        opt.step()
    assert all(p.dtype == torch.bfloat16 and bool(torch.isfinite(p).all()) for p in params)
    assert all(opt.state[p]["exp_avg"].dtype == torch.bfloat16 for p in params)
    assert not any(torch.equal(a, b) for a, b in zip(params, before))


def test_another_world_size_keeps_rank0_state_and_restarts_errors(caplog):
    import logging

    from lowbit_strategy import rank_state
    from lowbit_strategy.algorithms.onebit.algorithm import merge_states

    states = [{"optimizers": [{"state": {0: {"exp_avg": torch.full((2,), float(r))}},
                               "errors": {"world_size": 3, "errors": {"0": (torch.ones(2), torch.ones(8))}}}]}
              for r in range(3)]
    entry = {"world_size": 3, "states": states}
    with caplog.at_level(logging.WARNING, logger="lowbit_strategy.rank_state"):
        merged = rank_state.pick(entry, 0, 2, merge_states, "onebit_adam rank-local buffers")
    assert "world size 3, resuming with 2; onebit_adam rank-local buffers: Another world size" in caplog.text
    assert "error feedback restarts from 0" in caplog.text
    own = merged["optimizers"][0]
    assert torch.equal(own["state"][0]["exp_avg"], torch.zeros(2)) and own["errors"] == {}


def test_a_young_frozen_variance_is_logged_where_the_steps_are_unbounded(caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="lowbit_strategy.algorithms.onebit.optimizer"):
        OneBitAdam(_model().parameters(), freeze_step=10, update_clip=None)
    assert "freeze_step=10 freezes a variance holding 1.0% of its averaging weight" in caplog.text
    assert "update_clip='auto'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowbit_strategy.algorithms.onebit.optimizer"):
        OneBitLamb(_model().parameters(), freeze_step=60, update_clip=None)
        OneBitAdam(_model().parameters(), freeze_step=10)  # bounded steps: nothing to warn of
    assert caplog.text == ""


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern (0.0 and -0.0 differ, NaNs compare)."""
    return t.detach().contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class _PerParameterLamb(OneBitLamb):
    """1-bit LAMB stepping one parameter at a time (its per-parameter methods, as before the
    multi-tensor step): the oracle of the batched step."""

    def _warmup_all(self, active, step):
        for grp, p in active:
            self._warmup(grp, p, p.grad, step)

    def _compressed_all(self, items, step):
        for grp, p, mean in items:
            self._compressed(grp, p, mean, step)


def _lamb_zoo(seed: int = 0) -> list[nn.Parameter]:
    """Parameters of many shapes, a bf16 one, a 0-d one, an empty one, a frozen one and an
    all-zero one (zero weight and zero gradient: both norms 0)."""
    torch.manual_seed(seed)
    shapes = [(12, 6), (12,), (3, 4, 5), (7, 1, 2, 2), (), (0, 3), (5,), (4, 4), (9,)]
    params = [nn.Parameter(torch.randn(s)) for s in shapes]
    params[6] = nn.Parameter(torch.zeros(5))  # zero weight, zero gradient
    params[7] = nn.Parameter(torch.randn(4, 4).to(torch.bfloat16))
    params[8].requires_grad_(False)  # frozen: never a gradient
    return params


def _lamb_zoo_grads(step: int, params) -> None:
    gen = torch.Generator().manual_seed(2000 + step)
    for i, p in enumerate(params):
        if not p.requires_grad:
            continue
        g = torch.randn(p.shape, generator=gen).to(p.dtype) * (1 + i)
        p.grad = None if (i == 3 and step % 3 == 0) else (torch.zeros_like(p) if i == 6 else g)


@pytest.mark.parametrize("update_clip", ["auto", 0.5])  # 0.5 binds on these gradients
@pytest.mark.parametrize("multi", [False, True], ids=["chains", "multi_tensor"])
@pytest.mark.parametrize("weight_decay", [0.0, WD])
def test_batched_lamb_step_is_the_per_parameter_step_bit_for_bit(weight_decay, multi, update_clip):
    """The batched 1-bit LAMB step (the trust ratios as one vector), with its tensor chains per
    parameter (CPU's default) or as multi-tensor ops (``multi_tensor``, CUDA's default, forced
    here on CPU, where each ``_foreach_`` op runs the single-tensor kernel per tensor), equals
    the per-parameter formula bit for bit, in warm-up, at the switch and in the compression
    stage, with two parameter groups, mixed dtypes, a 0-d, an empty, a frozen, an all-zero
    parameter and one whose gradient is sometimes None; and after a state is loaded (the
    cached frozen denominators follow the new variance)."""
    runs = []
    for cls in (_PerParameterLamb, OneBitLamb):
        params = _lamb_zoo()
        groups = [dict(params=params[:5]), dict(params=params[5:], lr=LR / 3, weight_decay=weight_decay / 2,
                                                min_coeff=0.5, max_coeff=2.0)]
        opt = cls(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay, freeze_step=4, update_clip=update_clip)
        opt.multi_tensor = multi if cls is OneBitLamb else None
        chains = []
        for name in ("_warmup_chain", "_compressed_chain"):
            real = getattr(opt, name)
            setattr(opt, name, lambda *a, real=real: (chains.append(1), real(*a))[1])
        for step in range(1, 10):
            _lamb_zoo_grads(step, params)
            opt.step()
            if step == 6:  # a loaded state: new exp_avg_sq tensors (the frozen denominators follow)
                state = copy.deepcopy(opt.state_dict())
                for s in state["state"].values():
                    s["exp_avg_sq"] = s["exp_avg_sq"] * 2
                opt.load_state_dict(state)
        if cls is OneBitLamb:
            assert bool(chains) != multi  # the per-parameter chains ran only when not multi-tensor
        runs.append((params, opt))
    (ref, ref_opt), (ours, opt) = runs
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(ref, ours))
    for a, b in zip(ref, ours):
        sa, sb = ref_opt.state[a], opt.state[b]
        assert set(sa) == set(sb)
        assert all(torch.equal(_bits(sa[k]), _bits(sb[k])) for k in sa)
    assert {"exp_avg_sq_fresh", "lamb_coeff_freeze", "last_factor", "scaling_coeff", "variance_ratio"} <= set(
        opt.state[ours[0]])
    assert ours[8].grad is None and torch.equal(ours[8], _lamb_zoo()[8])  # the frozen one: untouched


@pytest.mark.parametrize("update_clip", ["auto", 0.5])  # 0.5 binds on these gradients
@pytest.mark.parametrize("weight_decay", [0.0, WD])
def test_multi_tensor_adam_step_is_the_per_parameter_step_bit_for_bit(weight_decay, update_clip):
    """1-bit Adam's multi-tensor compression stage (CUDA's default, forced here on CPU, where
    each ``_foreach_`` op runs the single-tensor kernel per tensor) equals the per-parameter
    step bit for bit: two parameter groups, bf16, a 0-d, an empty, a frozen, an all-zero
    parameter (its frozen variance 0: masked) and one whose gradient is sometimes None; and
    after a state is loaded (the cached mask follows the new variance)."""
    runs = []
    for multi in (False, True):
        params = _lamb_zoo()
        groups = [dict(params=params[:5]), dict(params=params[5:], lr=LR / 3, weight_decay=weight_decay / 2)]
        opt = OneBitAdam(groups, lr=LR, betas=BETAS, eps=EPS, weight_decay=weight_decay, freeze_step=4,
                         update_clip=update_clip)
        opt.multi_tensor = multi
        calls = []
        real = opt._compressed
        opt._compressed = lambda *a, calls=calls, real=real: (calls.append(1), real(*a))
        for step in range(1, 10):
            _lamb_zoo_grads(step, params)
            opt.step()
            if step == 6:  # a loaded state: new exp_avg_sq tensors, with new zeros (masked from now on)
                state = copy.deepcopy(opt.state_dict())
                for s in state["state"].values():
                    s["exp_avg_sq"] = s["exp_avg_sq"] * 2
                    s["exp_avg_sq"].view(-1)[:1] = 0
                opt.load_state_dict(state)
        assert bool(calls) != multi  # the per-parameter form ran only when asked
        runs.append((params, opt))
    (ref, ref_opt), (ours, opt) = runs
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(ref, ours))
    for a, b in zip(ref, ours):
        sa, sb = ref_opt.state[a], opt.state[b]
        assert set(sa) == set(sb) and all(torch.equal(_bits(sa[k]), _bits(sb[k])) for k in sa)
    assert torch.count_nonzero(opt.state[ours[6]]["exp_avg_sq"]) == 0  # the masked one was there
    assert torch.equal(ours[6], torch.zeros(5))


@pytest.mark.parametrize("multi", [False, True], ids=["chains", "multi_tensor"])
def test_frozen_variance_constants_are_computed_once_and_follow_every_change(monkeypatch, multi):
    """The mask (``v == 0``) and denominator 1-bit Adam keeps for its frozen variance give the
    floats computed afresh at every step, through a loaded state, an in-place write of the
    variance and a changed eps; and they are computed once per change, not per step."""
    from lowbit_strategy.algorithms.staged import adam

    real = adam.adam_denominator
    runs = []
    for fresh in (True, False):
        calls = []
        monkeypatch.setattr(adam, "adam_denominator", lambda v, **kw: (calls.append(1), real(v, **kw))[1])
        params = _lamb_zoo()
        opt = OneBitAdam(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, freeze_step=4)
        opt.multi_tensor = multi
        for step in range(1, 12):
            _lamb_zoo_grads(step, params)
            if fresh:  # the reference: nothing kept from one step to the next
                opt._frozen_cache.clear()
            opt.step()
            if step == 5:  # a loaded state: new variance tensors
                state = copy.deepcopy(opt.state_dict())
                for st in state["state"].values():
                    st["exp_avg_sq"] = st["exp_avg_sq"] * 2
                opt.load_state_dict(state)
            elif step == 7:  # written in place (its version moves)
                with torch.no_grad():
                    for st in opt.state.values():
                        st["exp_avg_sq"].mul_(3)
            elif step == 9:
                opt.param_groups[0]["eps"] = EPS * 100
        runs.append((params, len(calls), len(opt._frozen_cache)))
    (ref, fresh_calls, _), (ours, kept_calls, kept) = runs
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(ref, ours))
    # kept: computed at compression steps 5, 6 (loaded), 8 (written) and 10 (eps) only; afresh:
    # at each of the 7 compression steps where the parameter has a gradient
    assert kept > 0 and kept_calls == 4 * kept and fresh_calls > 6 * kept, (fresh_calls, kept_calls, kept)


@pytest.mark.parametrize("cls", [OneBitAdam, OneBitLamb])
def test_frozen_variance_constants_follow_the_values_not_the_tensor_objects(cls):
    """On the sharded path every step hands the optimizer new local views of the same
    parameters and state (``layout.local_step``): the kept constants are found again through
    new views (one computation, no entry per step), a view of other values gets its own, and
    an entry a compressed step did not use is dropped at its end."""
    opt = cls([nn.Parameter(torch.randn(6, 4))], lr=LR, freeze_step=1)
    v = torch.rand(6, 4)
    v[0, 0] = 0
    first = opt._frozen(v, 0.999, EPS)
    for _ in range(3):  # new view objects of the same values
        again = opt._frozen(v.view(6, 4), 0.999, EPS)
        assert again[0] is first[0] and again[1] is first[1]
    assert len(opt._frozen_cache) == 1 and bool(first[0][0, 0]) and int(first[0].sum()) == 1
    other = opt._frozen(v[3:], 0.999, EPS)  # other values of the same storage: their own
    assert len(opt._frozen_cache) == 2 and torch.equal(other[1], first[1][3:])
    opt._before_compressed_update(True)  # a step that uses only the first: the second is dropped
    opt._frozen(v.view(6, 4), 0.999, EPS)
    opt._after_compressed_update(2)
    assert len(opt._frozen_cache) == 1


def test_lamb_resumes_bit_for_bit_in_the_compression_stage():
    """A state dict saved in the compression stage resumes bit for bit (the frozen
    denominators the step keeps outside the state are rebuilt from the loaded variance), and
    the state holds the keys it always held (a run saved by the per-parameter step loads)."""
    def steps(opt, params, first, last):
        for step in range(first, last + 1):
            _lamb_zoo_grads(step, params)
            opt.step()

    straight = _lamb_zoo()
    steps(OneBitLamb(straight, lr=LR, weight_decay=WD, freeze_step=3), straight, 1, 9)
    half = _lamb_zoo()
    old = _PerParameterLamb(half, lr=LR, weight_decay=WD, freeze_step=3)  # saved by the old step
    steps(old, half, 1, 6)
    saved = copy.deepcopy(old.state_dict())
    resumed = OneBitLamb(half, lr=LR, weight_decay=WD, freeze_step=3)
    resumed.load_state_dict(saved)
    steps(resumed, half, 7, 9)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(straight, half))
    # the cache follows the state: a variance written in place is seen on the next step
    resumed.state[half[0]]["exp_avg_sq"].mul_(4)
    ref = _PerParameterLamb(_lamb_zoo(), lr=LR, weight_decay=WD, freeze_step=3)
    ref.load_state_dict(copy.deepcopy(resumed.state_dict()))
    ref_params = [p for grp in ref.param_groups for p in grp["params"]]
    with torch.no_grad():
        for p, h in zip(ref_params, half):
            p.copy_(h)
    steps(resumed, half, 10, 10)
    steps(ref, ref_params, 10, 10)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(ref_params, half))
