"""DeMo in one process: the optimizer against the paper's DeMo written independently
(:func:`tests.algorithms.demo.oracle.reference_step`), the oracle over N workers against the
same reference, the codec's layout of what it sends, and every bad argument."""
from __future__ import annotations

import pytest
import torch

from lowbit_strategy import DeMo, LowBitConfig
from lowbit_strategy.config import ConfigError
from tests import training
from tests.algorithms.demo import oracle

STEPS = 12


#: a decoded mean within this of 0 (relative to the tensor's largest) is a near-tie: the sign of
#: rounding noise (an exactly-zero gradient element, decoded through two transforms), which two
#: correct implementations may resolve differently
NEAR_TIE = 1e-5


def _check_step(params, updates_before, updates_ref, changes, name):
    for p, u, change in zip(params, updates_ref, changes):
        decided = u.abs() > NEAR_TIE * u.abs().max().clamp_min(1e-30)
        want = -oracle.LR * torch.sign(u)
        assert torch.allclose(change[decided], want[decided], atol=1e-7, rtol=0), name
        assert int((~decided).sum()) <= max(2, u.numel() // 20), f"{name}: too many near-ties"


def _dense_model() -> torch.nn.Module:
    """Every gradient element generically nonzero (no embedding rows left out, no dead ReLU):
    no coefficient ties in exact arithmetic, so a difference is rounding's, not a tie-break's."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5),
                               torch.nn.Conv1d(1, 4, 3))


def _dense_loss(net, t):
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(8, 12, generator=gen)
    h = net[2](net[1](net[0](x)))
    return (net[3](h.unsqueeze(1)) - 0.3).pow(2).mean()


def test_each_step_equals_the_papers_demo_to_rounding():
    """Every step from the same weights and momenta: the momenta agree to rounding, and every
    weight moves as the paper's DeMo moves it wherever the sign is not a near-tie. (A conv
    weight, 3-D, is read as the matrix out x in·kernel, where the paper's code has no rule.)"""
    net = _dense_model()
    opt = oracle.make(net.parameters())
    params = list(net.parameters())
    for t in range(1, STEPS + 1):
        weights = [p.detach().clone() for p in params]
        deltas = [opt.delta(p).clone() for p in params]
        opt.zero_grad()
        _dense_loss(net, t).backward()
        grads = [p.grad.clone() for p in params]
        ref_w, ref_d = [[w.clone() for w in weights]], [[d.clone() for d in deltas]]
        flat = lambda ts: [x.reshape(x.shape[0], -1) if x.dim() > 2 else x for x in ts]  # noqa: E731
        updates = oracle.reference_step([flat(ref_w[0])], [flat(ref_d[0])], [flat(grads)], lr=oracle.LR,
                                        decay=oracle.DECAY, topk=oracle.TOPK, chunk=oracle.CHUNK, wd=oracle.WD)
        opt.step()
        for p, r in zip(params, ref_d[0]):
            torch.testing.assert_close(opt.delta(p), r, rtol=0, atol=1e-7)
        changes = [(p.detach() - w * (1 - oracle.LR * oracle.WD)).reshape(u.shape)
                   for p, w, u in zip(params, weights, updates)]
        _check_step(params, deltas, updates, changes, f"step {t}")
    assert not torch.equal(training.flat(net), training.flat(_dense_model()))


def test_the_codecs_mean_over_workers_equals_the_papers_to_rounding():
    """fp32 values: the codec's per-coefficient mean of 3 workers' payloads, decoded, against
    the paper's concatenate-and-scatter_reduce mean (different workers keep different
    coefficients, so counts differ per coefficient)."""
    from lowbit_strategy.codecs.topk import TopKCodec

    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 24), (20, 8), (16,), (5, 16), (5,)]
    codec = TopKCodec(shapes, oracle.CHUNK, oracle.TOPK, "fp32", "cpu")
    workers = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    payloads = torch.stack([codec.encode(w)[0] for w in workers])
    got = codec.mean(payloads, workers[0])
    for i, s in enumerate(shapes):
        coeffs = [oracle._encode(w[i], oracle.CHUNK) for w in workers]
        picks = [oracle._sparse(c, oracle.TOPK) for c in coeffs]
        idx = torch.cat([p[0] for p in picks], -1)
        val = torch.cat([p[1] for p in picks], -1)
        want = oracle._decode(oracle._dense(coeffs[0].shape, idx, val)).reshape(s)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)


def test_delay_one_applies_each_update_a_step_late():
    now = training.flat(oracle.demo(2, 1)[0])
    late = oracle.demo(2, 1, delay=1)
    assert torch.equal(training.flat(late[0]), training.flat(training.model()))  # nothing applied yet
    assert not torch.equal(now, training.flat(training.model()))


def test_values_change_the_trajectory_but_keep_the_update_shared():
    base = training.flat(oracle.demo(2, 6, values="fp32")[0])
    for values in ("bf16", "sign"):
        nets = oracle.demo(2, 6, values=values)
        assert torch.equal(training.flat(nets[0]), training.flat(nets[1]))
        assert not torch.equal(training.flat(nets[0]), base), values


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(compression_topk=0), "compression_topk"),
        (dict(compression_chunk=0), "compression_chunk"),
        (dict(compression_decay=1.0), "compression_decay"),
        (dict(compression_decay=-0.1), "compression_decay"),
        (dict(lr=-1.0), "lr"),
        (dict(weight_decay=-1.0), "weight_decay"),
        (dict(compression_topk=2.5), "compression_topk"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DeMo(training.model().parameters(), **kwargs)


@pytest.mark.parametrize("section, field", [({"values": "int4"}, "demo.values"), ({"delay": 2}, "demo.delay"),
                                            ({"delay": -1}, "demo.delay")])
def test_bad_config_names_the_field(section, field):
    with pytest.raises(ConfigError, match=field):
        LowBitConfig(algorithm="demo", demo=section)


def test_shorthand_and_environment():
    assert LowBitConfig(algorithm="demo", values="bf16").demo.values == "bf16"
    assert LowBitConfig(algorithm="demo").demo.values == "sign"
    cfg = LowBitConfig.from_env({"LOWBIT_ALGORITHM": "demo", "LOWBIT_DEMO_DELAY": "1"})
    assert cfg.algorithm == "demo" and cfg.demo.delay == 1


def test_a_non_finite_gradient_skips_the_step_and_keeps_the_momentum():
    net = training.model()
    opt = oracle.make(net.parameters())
    for t in (1, 2):
        opt.zero_grad()
        training.loss(net, 0, t).backward()
        opt.step()
    before = training.flat(net).clone()
    deltas = [opt.delta(p).clone() for p in net.parameters()]
    opt.zero_grad()
    (training.loss(net, 0, 3) * float("inf")).backward()
    opt.step()
    assert opt.skipped_steps == 1
    assert torch.equal(training.flat(net), before)
    assert all(torch.equal(opt.delta(p), d) for p, d in zip(net.parameters(), deltas))
