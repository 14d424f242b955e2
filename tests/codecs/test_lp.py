import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lowbit_strategy.codecs import levels_for_bits, lp_norm_mean, lp_quantize, lp_quantize_levels, lp_quantize_many

P_VALUES = st.sampled_from([0.0, 1.0, 2.0, math.inf])
BITS = st.integers(2, 16)
vectors = st.lists(
    st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32) | st.just(0.0),
    min_size=1,
    max_size=80,
)


def _oracle_mean(values, p):
    a = np.abs(np.asarray(values, dtype=np.float32).astype(np.float64))
    if p == math.inf:
        return a.max()
    if p == 0.0:
        nz = a[a > 0]
        return math.exp(np.log(nz).mean()) if nz.size else 0.0
    return (np.mean(a**p)) ** (1 / p)


def _oracle(values, bits, p):
    """Brute-force Q_p in float64 (Lion Cub Eq. 1), and the scaled values before rounding."""
    m = _oracle_mean(values, p)
    L = 2 ** (bits - 1) - 1
    if m == 0:
        return np.zeros(len(values)), np.zeros(len(values))
    scaled = np.asarray(values, dtype=np.float32).astype(np.float64) * L / (2 * m)
    return np.clip(np.round(scaled), -L, L), scaled


@given(vectors, BITS, P_VALUES)
def test_matches_brute_force_oracle(values, bits, p):
    codes = lp_quantize(torch.tensor(values, dtype=torch.float32), bits, p)
    expected, scaled = _oracle(values, bits, p)
    # Eq. 1 holds while M_p is a normal float32 (module docstring); below, only sign/range
    # (test_codes_bounds_dtype_and_sign covers every input)
    m, f32 = _oracle_mean(values, p), np.finfo(np.float32)
    assume(m == 0 or (m >= f32.tiny and levels_for_bits(bits) / (2 * m) < f32.max))
    got = codes.numpy().astype(np.float64)
    # float32 vs float64 arithmetic may only disagree right at a rounding boundary
    near_half = np.abs(np.abs(scaled - np.floor(scaled)) - 0.5) < 1e-3 * np.maximum(1.0, np.abs(scaled))
    mismatch = got != expected
    assert not np.any(mismatch & ~near_half), (got, expected)
    assert np.all(np.abs(got - expected) <= 1)


@given(vectors, BITS, P_VALUES)
def test_codes_bounds_dtype_and_sign(values, bits, p):
    x = torch.tensor(values, dtype=torch.float32)
    codes = lp_quantize(x, bits, p)
    L = levels_for_bits(bits)
    assert codes.dtype == (torch.int8 if bits <= 8 else torch.int16)
    assert codes.shape == x.shape
    assert int(codes.abs().max()) <= L
    # a code never has the opposite sign of its input
    assert bool(((codes.float() * x) >= 0).all())
    # order preserving
    order = torch.argsort(x)
    assert bool((codes[order][1:] >= codes[order][:-1]).all())


@given(vectors, BITS, st.sampled_from([1.0, 2.0, math.inf]), st.integers(-20, 20))
def test_scale_invariance_exact_for_powers_of_two(values, bits, p, k):
    x = torch.tensor(values, dtype=torch.float32)
    nonzero = x.abs()[x != 0]
    assume(nonzero.numel() == 0 or (float(nonzero.max()) * 2.0**k < 1e30 and float(nonzero.min()) * 2.0**k > 1e-30))
    assert torch.equal(lp_quantize(x * 2.0**k, bits, p), lp_quantize(x, bits, p))


@given(vectors, BITS, st.floats(0.01, 100.0))
def test_scale_invariance_geometric_mean_within_one_code(values, bits, c):
    x = torch.tensor(values, dtype=torch.float32)
    nonzero = x.abs()[x != 0]
    # scaling a subnormal (e.g. 1.4e-45 * 0.5 -> 0) loses the value itself: stay normal
    assume(nonzero.numel() == 0 or min(float(nonzero.min()), float(nonzero.min()) * c) > 1e-30)
    a, b = lp_quantize(x * c, bits, 0), lp_quantize(x, bits, 0)
    assert int((a.int() - b.int()).abs().max()) <= 1


@pytest.mark.parametrize("p", [0, 1, 2, math.inf])
def test_all_zero_input_gives_zero_codes(p):
    assert lp_quantize(torch.zeros(17), 8, p).eq(0).all()
    assert lp_quantize(torch.zeros(3, 4, dtype=torch.bfloat16), 4, p).eq(0).all()


def test_geometric_mean_ignores_exact_zeros():
    x = torch.tensor([0.0, 0.0, 1.0, 4.0])
    assert float(lp_norm_mean(x, 0)) == pytest.approx(2.0)
    # ... so non-zero entries keep distinct codes instead of all saturating
    assert lp_quantize(x, 8, 0).tolist() == [0, 0, 32, 127]


def test_l1_keeps_small_entries_where_linf_zeroes_them():
    # Lion Cub Sec. 4.1: one outlier makes Q_inf map the rest to zero; Q_1 does not.
    x = torch.full((1000,), 1e-3)
    x[0] = 10.0
    assert int((lp_quantize(x, 5, math.inf)[1:] != 0).sum()) == 0
    assert int((lp_quantize(x, 5, 1)[1:] != 0).sum()) == 999


def test_levels_api_matches_bits_api():
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(lp_quantize_levels(x, 127, 1), lp_quantize(x, 8, 1))
    codes = lp_quantize_levels(x, 15, 1)
    assert int(codes.abs().max()) <= 15


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match=r"bits must be an int in \[2, 16\]"):
        lp_quantize(torch.ones(3), 1)
    with pytest.raises(ValueError, match=r"bits must be an int in \[2, 16\]"):
        lp_quantize(torch.ones(3), 17)
    with pytest.raises(ValueError, match="p must be one of 0, 1, 2, inf"):
        lp_quantize(torch.ones(3), 8, p=3)
    with pytest.raises(TypeError, match="floating-point"):
        lp_quantize(torch.ones(3, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="empty"):
        lp_quantize(torch.ones(0), 8)
    with pytest.raises(ValueError, match="NaN or Inf"):
        lp_quantize(torch.tensor([1.0, float("inf")]), 8)
    with pytest.raises(ValueError, match="levels must be an int"):
        lp_quantize_levels(torch.ones(3), 0)


@settings(max_examples=60)
@given(st.integers(1, 3000), st.integers(0, 3000), st.integers(0, 2**31 - 1))
def test_geometric_mean_is_bitwise_the_plain_formula(n, zeros, seed):
    """Few or many exact zeros (both selection paths), the value equals the textbook
    float64 expression bit for bit."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-12, 4, (n,), generator=g)
    x[torch.randint(0, n, (zeros,), generator=g)] = 0.0
    a = x.abs().double()
    nonzero = a[a > 0]
    expected = nonzero.log().mean().exp() if nonzero.numel() else torch.zeros((), dtype=torch.float64)
    assert torch.equal(lp_norm_mean(x, 0), expected)


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, math.inf])
@pytest.mark.parametrize("levels", [7, 127, 2000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_batched_is_each_tensor_with_its_own_scale(p, levels, dtype):
    """A bucket quantized in one chain (the GPU form) gives each tensor's own codes, bit for
    bit: its own scale, the same product, rounding, clamp and cast."""
    g = torch.Generator().manual_seed(int(levels + 10 * (p if p < math.inf else 9)))
    xs = [torch.randn(n, generator=g).mul_(10.0 ** float(torch.randint(-12, 3, (), generator=g))).to(dtype)
          for n in (1, 300, 4099, 70000)]
    xs[1][::3] = 0.0
    xs[2][7] = 1e4  # an outlier that saturates
    xs.insert(2, torch.zeros(64, dtype=dtype))  # M_p = 0: all-zero codes
    want = torch.cat([lp_quantize_levels(x.reshape(-1), levels, p, validate=False) for x in xs])
    got = lp_quantize_many([x.view(-1, 1) if x.numel() % 2 == 0 else x for x in xs], levels, p, batched=True)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(lp_quantize_many(xs, levels, p), want)  # the CPU's per-tensor form
    # (not vacuous: the outlier saturates, or with p = inf, M = max|x|, it reaches L/2)
    assert got.abs().max() == (levels if p < math.inf else round(levels / 2))
