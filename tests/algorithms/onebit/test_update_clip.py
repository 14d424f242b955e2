"""The compression stage's bound on each coordinate's step (``update_clip``) and the guard.

The failure they exist for: a coordinate whose frozen variance is tiny but not 0 (an
attention key bias: its exact gradient is 0 because the softmax does not see a constant added
to every key; its float gradient is rounding noise) receives, through the 1-bit code, its
block's scale as momentum, and ``m̂ / (sqrt(v̂) + eps)`` turns that into a step of ~1e6·lr.
Here the same mechanism on a small classifier whose logits get a learned constant added to
every class (cross-entropy cannot see it either)."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import lowbit_strategy
from lowbit_strategy import LowBitConfig, OneBitAdam, OneBitLamb
from lowbit_strategy.algorithms.onebit.optimizer import DivergenceError, adam_step_bound
from tests.distributed import run_ranks
from tests.training import batch

LR, FREEZE, STEPS = 1e-2, 3, 8


def _tiny_variance_run(update_clip, multi=None):
    """Coordinate 0 sees gradients ~1, coordinate 1 rounding noise (1e-12) during warm-up;
    after the switch both get a momentum of ~1e-3 (what a 1-bit code of a block whose scale
    is 1e-3 hands every coordinate). Returns the parameter's last step."""
    p = nn.Parameter(torch.zeros(2))
    opt = OneBitAdam([p], lr=LR, freeze_step=3, update_clip=update_clip)
    opt.multi_tensor = multi
    for step in range(1, 5):
        p.grad = torch.tensor([1.0, 1e-12]) if step <= 3 else torch.tensor([1e-3, 1e-2])
        before = p.detach().clone()
        opt.step()
    return p.detach() - before


def test_auto_bound_is_adams_own():
    assert adam_step_bound(0.9, 0.999) == pytest.approx(0.1 / 0.001**0.5)
    assert adam_step_bound(0.9, 0.95) == 1.0
    for cls in (OneBitAdam, OneBitLamb):
        assert cls([nn.Parameter(torch.zeros(1))]).update_clip == pytest.approx(3.1623, abs=1e-4)
        assert cls([nn.Parameter(torch.zeros(1))], update_clip=None).update_clip is None


@pytest.mark.parametrize("multi", [False, True])
def test_a_tiny_variance_coordinate_takes_at_most_the_bound(multi):
    free = _tiny_variance_run(None, multi)
    assert free[1].abs() > 1e3 * LR  # the paper's form: lr · m̂ / ~eps
    for clip in (1.0, "auto"):
        step = _tiny_variance_run(clip, multi)
        bound = 1.0 if clip == 1.0 else adam_step_bound(0.9, 0.999)
        assert step[1].abs() <= LR * bound * (1 + 1e-6)
        assert step[0] == free[0]  # an ordinary coordinate: untouched


def test_warmup_is_adamw_bit_for_bit_with_any_clip():
    torch.manual_seed(0)
    ps = [nn.Parameter(torch.randn(4, 3)) for _ in range(2)]
    ref = [nn.Parameter(p.detach().clone()) for p in ps]
    opt = OneBitAdam(ps, lr=LR, weight_decay=0.1, freeze_step=5, update_clip=0.01)
    adamw = torch.optim.AdamW(ref, lr=LR, weight_decay=0.1, foreach=False)
    for step in range(5):
        gen = torch.Generator().manual_seed(step)
        for a, b in zip(ps, ref):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        adamw.step()
    assert all(torch.equal(a, b) for a, b in zip(ps, ref))


class Shifted(nn.Module):
    """Embedding -> linear logits, plus a bias vector whose first 5 entries are the classes'
    biases and whose last 4 add one constant to every class (as a fused qkv bias holds the
    key bias beside the query and value biases): their exact gradient is 0 (softmax's shift
    invariance), their float gradient rounding noise."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(20, 8), nn.Linear(24, 5, bias=False)
        self.bias = nn.Parameter(torch.zeros(9))

    def forward(self, x):
        return self.head(self.emb(x).flatten(1)) + self.bias[:5] + self.bias[5:].sum()


def _shift(model: Shifted) -> torch.Tensor:
    return model.bias.detach()[5:]


def _train(rank, cls, **kw):
    """(model, the step that raised DivergenceError or None, the error's message)."""
    net = nn.parallel.DistributedDataParallel(Shifted())
    opt = cls(net.parameters(), lr=LR, freeze_step=FREEZE, **kw)
    lowbit_strategy.attach(net, [opt], LowBitConfig(algorithm="onebit_adam" if cls is OneBitAdam else "onebit_lamb"))
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        x, y = batch(rank, step)
        nn.functional.cross_entropy(net(x), y).backward()
        try:
            opt.step()
        except DivergenceError as e:
            return net.module, step, str(e)
        if step == FREEZE:  # rounding noise, not 0: the mask for never-seen coordinates misses it
            v = opt.state[net.module.bias]["exp_avg_sq"]
            assert bool((v[5:] > 0).all()) and float(v[5:].max()) < 1e-12 < float(v[:5].min()), v
    return net.module, None, ""


def _every_rank(value: int) -> list[int]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _check(rank, world_size):
    for cls in (OneBitAdam, OneBitLamb):
        # the papers' form: the shift's first compressed steps are enormous; the guard stops the
        # run on every rank at the next step's verdict, naming the remedy
        _, raised, said = _train(rank, cls, update_clip=None)
        assert _every_rank(raised) == [FREEZE + 2] * world_size, raised
        assert "update_clip='auto'" in said and "freeze_step" in said and "guard=None" in said, said
        # without the guard it trains on, the shift flung far away
        model, raised, _ = _train(rank, cls, update_clip=None, guard=None)
        flung = float(_shift(model).abs().max())
        assert raised is None and flung > 100 * LR
        # the default: every compressed step of the shift within Adam's own bound (times LAMB's
        # frozen trust coefficient, at most max_coeff · factor_max = 40), no alarm
        model, raised, _ = _train(rank, cls)
        assert raised is None
        scale = 1.0 if cls is OneBitAdam else 40.0
        bound = adam_step_bound(0.9, 0.999) * LR * scale * (1 + 1e-5)
        moved = float(_shift(model).abs().max())
        assert moved <= (STEPS - FREEZE) * bound + FREEZE * LR * scale * 1.01 and moved < flung / 10, (moved, flung)


@pytest.mark.slow
def test_a_shift_invariant_parameter_is_bounded_or_stops_the_run_on_every_rank():
    run_ranks(2, _check)
