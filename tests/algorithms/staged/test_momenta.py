"""The staged optimizers form a bucket's momenta straight into the communicator's buffer
(:class:`~lowbit_strategy.algorithms.staged.communicator.Formed`): the same floats as forming
each momentum and flattening them, for any part of the bucket and any parameter dtype."""

import pytest
import torch
from torch import nn

from lowbit_strategy import OneBitAdam, OneBitLamb
from lowbit_strategy.algorithms.staged import StagedOptimizer
from lowbit_strategy.buckets import flatten_range


def _items(opt_class):
    gen = torch.Generator().manual_seed(3)
    shapes_dtypes = [((5, 7), torch.float32), ((13,), torch.bfloat16), ((4, 3, 2), torch.float32),
                     ((9,), torch.float16)]
    params = [nn.Parameter(torch.randn(s, generator=gen).to(d)) for s, d in shapes_dtypes]
    opt = opt_class(params, lr=1e-3, freeze_step=2)
    items = []
    for i, p in enumerate(params):
        state = opt._state(p)
        state["exp_avg"].copy_(torch.randn(p.shape, generator=gen))
        state["scaling_coeff"] = torch.tensor(0.75 + 0.1 * i)  # (1-bit LAMB's, Sec. 4.3)
        items.append((opt.param_groups[0], p, torch.randn(p.shape, generator=gen).to(p.dtype)))
    return opt, items


@pytest.mark.parametrize("opt_class", [OneBitAdam, OneBitLamb])
@pytest.mark.parametrize("lo,hi", [(0, 35 + 13 + 24 + 9), (0, 1), (30, 50), (36, 48), (50, 81), (48, 72)])
def test_momenta_formed_in_place_equal_the_flattened_momenta(opt_class, lo, hi):
    opt, items = _items(opt_class)
    formed = [opt._local_momentum(group, p, grad) for group, p, grad in items]
    want = flatten_range(formed, lo, hi, out=torch.empty(hi - lo))
    got = torch.full((hi - lo,), float("nan"))
    opt._momenta_into(items, lo, hi, got)
    assert torch.equal(got, want)
    assert not torch.equal(formed[0], opt.state[items[0][1]]["exp_avg"])  # a real update was formed


def test_lamb_scales_the_momenta_it_forms_in_place():
    """1-bit LAMB's momenta go out scaled by their coefficients (Sec. 4.3), formed in place too."""
    opt, items = _items(OneBitLamb)
    group, p, grad = items[0]
    got = torch.empty(p.numel())
    opt._momenta_into(items[:1], 0, p.numel(), got)
    plain = StagedOptimizer._local_momentum(opt, group, p, grad).reshape(-1)
    assert torch.equal(got, plain * opt.state[p]["scaling_coeff"])
    assert not torch.equal(got, plain)
