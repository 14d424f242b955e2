"""rank_sum: the ranks' fixed pairwise summation order, against a pure-Python oracle."""

import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lowbit_strategy.codecs.reduce import divide, nonfinite_flag, rank_sum


def f32(x: float) -> float:
    """``x`` rounded to float32 (round to nearest even)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def tree_sum(values: list, rounding=f32):
    """The pairwise order of :func:`rank_sum` on plain numbers: (v0 + v1), (v2 + v3), ... per
    level, an odd last value carried up, one rounding per addition."""
    while len(values) > 1:
        level = [rounding(values[i] + values[i + 1]) for i in range(0, len(values) - 1, 2)]
        values = level + values[-1:] if len(values) % 2 else level
    return values[0]


finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@given(st.lists(st.lists(finite32, min_size=3, max_size=3), min_size=1, max_size=17))
def test_rank_sum_is_the_pairwise_tree(rows):
    x = torch.tensor(rows, dtype=torch.float32)
    got = rank_sum(x)
    assert got.shape == (3,)
    assert got.tolist() == [tree_sum([r[i] for r in rows]) for i in range(3)]


def test_up_to_three_ranks_it_is_rank_order_and_ties_of_zero_keep_their_sign():
    x = torch.tensor([[1e8, -0.0], [1.0, -0.0], [-1e8, -0.0]])
    assert torch.equal(rank_sum(x[:2]), x[0] + x[1])
    assert torch.equal(rank_sum(x), (x[0] + x[1]) + x[2])
    assert torch.signbit(rank_sum(x)[1])  # -0 + -0 + -0 stays -0 (no +0 start value)
    y = torch.randn(8, 100)
    assert torch.equal(rank_sum(y), ((y[0] + y[1]) + (y[2] + y[3])) + ((y[4] + y[5]) + (y[6] + y[7])))
    assert torch.equal(rank_sum(y[:1]), y[0]) and torch.equal(y, y.clone())  # input untouched


def test_kernels_grow_with_log_p_only():
    from torch.profiler import ProfilerActivity, profile

    def ops(p):
        x = torch.randn(p, 1000)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            rank_sum(x)
        return sum(e.count for e in prof.key_averages() if e.key in ("aten::add", "aten::cat"))

    assert [ops(p) for p in (2, 4, 8, 16)] == [1, 2, 3, 4]


def test_no_rows_is_an_error():
    with pytest.raises(ValueError, match="at least one row"):
        rank_sum(torch.empty(0, 3))


@pytest.mark.parametrize("k", [1, 3, 5, 7, 64])
def test_divide_is_the_correctly_rounded_quotient(k):
    # float64 holds the quotient of two float32 values closely enough that rounding it to
    # float32 is the correctly rounded quotient: what CUDA's x · (1/k) misses by an ulp
    x = torch.rand(100_000, generator=torch.Generator().manual_seed(k)) * 3
    x[:3] = torch.tensor([0.0, -0.0, 2.0**-140])
    got = divide(x, k)
    assert got.dtype == torch.float32
    assert torch.equal(got.view(torch.int32), (x.double() / k).float().view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_nonfinite_flag_is_isfinite_all(dtype):
    """The device-side NaN/Inf verdict (one aminmax per tensor) says what ``~isfinite(t).all()``
    says, for every dtype, with any number of tensors and empty ones among them."""
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(n, generator=g).mul_(1e4).to(dtype) for n in (1, 1000, 4097)]
    assert not bool(nonfinite_flag(*xs)) and nonfinite_flag(*xs).dtype == torch.bool
    huge = torch.full((64,), torch.finfo(dtype).max, dtype=dtype)  # finite, though its sum overflows
    assert not bool(nonfinite_flag(huge, -huge))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i, at in ((0, 0), (1, 999), (2, 4096)):
            ys = [x.clone() for x in xs]
            ys[i][at] = bad
            want = any(bool(~torch.isfinite(y).all()) for y in ys)
            assert want and bool(nonfinite_flag(*ys)) == want and bool(nonfinite_flag(ys[i]))
    assert not bool(nonfinite_flag(torch.zeros(0), torch.zeros(0, 3)))
    assert bool(nonfinite_flag(torch.zeros(0), torch.tensor([float("nan")], dtype=dtype)))
