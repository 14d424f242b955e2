import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lowbit_strategy.codecs import sign_alternating, sign_bits, tie_is_positive

floats = st.lists(st.sampled_from([0.0, -0.0, 1.5, -2.0, 1e-30, -1e-30, math.inf, -math.inf]) | st.floats(-1e6, 1e6), min_size=1, max_size=64)


@given(floats, st.integers(1, 10_000))
def test_sign_bits_tie_rule(values, step):
    x = torch.tensor(values)
    b = sign_bits(x, step)
    assert b.dtype == torch.uint8
    for v, got in zip(x.tolist(), b.tolist()):  # the float32 values (tiny ones round to 0)
        if v > 0:
            assert got == 1
        elif v < 0:
            assert got == 0
        else:  # exact zero (either sign of zero): +1 on odd steps, -1 on even steps
            assert got == (1 if step % 2 == 1 else 0)


@given(floats, st.integers(1, 10_000))
def test_sign_alternating_is_never_zero_and_agrees_with_bits(values, step):
    x = torch.tensor(values)
    s = sign_alternating(x, step)
    assert s.dtype == torch.int8
    assert set(s.tolist()) <= {-1, 1}
    assert torch.equal(s, sign_bits(x, step).to(torch.int8) * 2 - 1)


def test_first_step_breaks_ties_upwards_then_alternates():
    assert [tie_is_positive(s) for s in (1, 2, 3, 4)] == [True, False, True, False]


def test_bad_inputs():
    with pytest.raises(ValueError, match="NaN"):
        sign_bits(torch.tensor([1.0, float("nan")]), 1)
    with pytest.raises(TypeError, match="step must be an int"):
        sign_bits(torch.ones(2), True)
    with pytest.raises(TypeError, match="step must be an int"):
        sign_bits(torch.ones(2), 1.0)


@given(st.lists(st.integers(0, 255), max_size=40), st.data())
def test_signs_from_bits_matches_unpack(byte_values, data):
    from lowbit_strategy.codecs import bits, signs_from_bits

    words = torch.tensor(byte_values, dtype=torch.uint8)
    n = data.draw(st.integers(0, 8 * len(byte_values)))
    expected = bits.unpack(words, 1, n).float() * 2 - 1
    assert torch.equal(signs_from_bits(words, n), expected)
    assert signs_from_bits(words, n, torch.bfloat16).dtype == torch.bfloat16


@given(floats, st.integers(1, 10_000), st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
def test_sign_bits_packed_is_pack_of_sign_bits(values, step, dtype):
    from lowbit_strategy.codecs import bits, sign_bits_packed

    x = torch.tensor(values).to(dtype)
    expected = bits.pack(sign_bits(x, step), 1)
    assert torch.equal(sign_bits_packed(x, step), expected)
    assert torch.equal(sign_bits_packed(x.view(-1, 1), step, check_nan=False), expected)


@given(st.integers(1, 300), st.data())
def test_nan_anywhere_raises(n, data):
    from lowbit_strategy.codecs import sign_bits_packed

    x = torch.randn(n)
    x[data.draw(st.integers(0, n - 1))] = math.nan
    for fn in (sign_bits, sign_bits_packed):
        with pytest.raises(ValueError, match="NaN"):
            fn(x, 1)
