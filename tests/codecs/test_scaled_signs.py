"""The scaled-sign codec against a brute-force oracle written element by element in Python.

Python floats are doubles; rounding one double operation on float32 operands back to
float32 gives exactly the float32 operation (+, -, *, / are correctly rounded in both), so
the oracle reproduces float32 arithmetic bit for bit. The scale is a norm, whose float32
value depends on the summation order: it is checked against the float64 formula within
the error bound of a float32 sum of ``n`` squares (``(n + 2)·2^-24`` relative), and
everything built from it is checked exactly given the returned scale. Values stay where
the float32 squares neither overflow nor underflow (the codec's documented range).
"""
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit_strategy.codecs import scaled_sign_compress, scaled_sign_decode, scaled_sign_mean


def f32(v: float) -> float:
    """Round a double to the nearest float32 (ties to even)."""
    return struct.unpack("f", struct.pack("f", v))[0]


def brute_compress(x: list[float], e: list[float], nbytes: int):
    """Element by element: v, sign(v) with sign(0) = +1, the bytes, the float64 scale."""
    v = [f32(a + b) for a, b in zip(x, e)]
    signs = [1 if a >= 0 else -1 for a in v]  # -0.0 >= 0 holds: -0.0 counts as +1
    packed = [0] * nbytes
    for i, s in enumerate(signs):
        if s > 0:
            packed[i // 8] |= 1 << (i % 8)
    scale64 = math.sqrt(sum(a * a for a in v) / len(v)) if v else 0.0
    return v, signs, packed, scale64


#: zeros, edge magnitudes of the documented range (squares within float32's normal range)
values = st.sampled_from([0.0, -0.0, 1.0, -1.0, 1e-15, -1e-15, 1e15]) | st.floats(-1e6, 1e6, width=32).filter(
    lambda v: v == 0 or abs(v) >= 1e-15
)
vectors = st.lists(values, min_size=0, max_size=70)


@settings(max_examples=200)
@given(vectors, st.data(), st.integers(0, 3), st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_compress_matches_brute_force(xs, data, extra_bytes, dtype):
    n = len(xs)
    x = torch.tensor(xs, dtype=torch.float32).to(dtype)
    e = torch.tensor(data.draw(st.lists(values, min_size=n, max_size=n)), dtype=torch.float32)
    x_before, e_before = x.clone(), e.clone()
    nbytes = -(-n // 8) + extra_bytes

    bits, scale = scaled_sign_compress(x, e, nbytes=nbytes)

    v, signs, packed, scale64 = brute_compress(x.float().tolist(), e_before.tolist(), nbytes)
    assert torch.equal(x, x_before), "x must not be modified"
    assert bits.dtype == torch.uint8 and bits.shape == (nbytes,)
    assert bits.tolist() == packed  # padding bits are 0
    assert scale.dtype == torch.float32 and scale.dim() == 0
    s = scale.item()
    assert s == pytest.approx(scale64, rel=(n + 2) * 2.0**-24, abs=0.0)
    # the error, exactly: v - s * sign(v), one float32 rounding per element
    expected = torch.tensor([f32(a - s * sg) for a, sg in zip(v, signs)], dtype=torch.float32)
    assert torch.equal(e, expected)


def test_float64_input_is_rounded_to_float32_before_adding():
    x = torch.tensor([1.0 + 2.0**-30, 1.0], dtype=torch.float64)  # x[0] rounds to 1.0 in float32
    e = torch.tensor([2.0**-24, 0.0], dtype=torch.float32)  # 1 + 2^-24 is a tie: rounds to 1.0
    scaled_sign_compress(x, e)
    # float32(x) + e = [1, 1]: s = 1 and no error; adding in float64 first gives v[0] = 1 + 2^-23
    assert e.tolist() == [0.0, 0.0]


def test_zeros_count_as_plus_one_and_an_all_zero_vector_keeps_zero_error():
    x = torch.tensor([0.0, -0.0, 0.0])
    e = torch.zeros(3)
    bits, scale = scaled_sign_compress(x, e)
    assert bits.tolist() == [0b111] and scale.item() == 0.0
    assert e.tolist() == [0.0, 0.0, 0.0] and not e.isnan().any()
    # a zero among non-zeros is sent as +s and the error remembers -s
    e = torch.zeros(2)
    bits, scale = scaled_sign_compress(torch.tensor([0.0, -2.0]), e)
    assert bits.tolist() == [0b01]
    assert scale.item() == pytest.approx(math.sqrt(2.0))
    assert e.tolist() == [-scale.item(), f32(-2.0 + scale.item())]


def test_outside_the_float32_range_of_the_squares():
    # squares that underflow add nothing to the scale: the error keeps what was not sent, no NaN
    e = torch.zeros(2)
    bits, scale = scaled_sign_compress(torch.tensor([1e-30, -1e-30]), e)
    assert scale.item() == 0.0 and bits.tolist() == [0b01]
    assert e.tolist() == [f32(1e-30), f32(-1e-30)]
    # squares that overflow give an infinite scale (documented): the caller keeps inputs in range
    _, scale = scaled_sign_compress(torch.tensor([1e20, 1.0]), torch.zeros(2))
    assert scale.isinf()


def test_empty_vector_and_default_nbytes():
    bits, scale = scaled_sign_compress(torch.zeros(0), torch.zeros(0), nbytes=3)
    assert bits.tolist() == [0, 0, 0] and scale.item() == 0.0
    bits, _ = scaled_sign_compress(torch.ones(9), torch.zeros(9))
    assert bits.tolist() == [255, 1]


def test_shapes_are_flattened_and_error_needs_only_the_element_count():
    x = torch.randn(3, 5)
    e = torch.zeros(15)
    bits, scale = scaled_sign_compress(x, e)
    e2 = torch.zeros(5, 3)
    bits2, scale2 = scaled_sign_compress(x.reshape(-1), e2)
    assert torch.equal(bits, bits2) and torch.equal(scale, scale2) and torch.equal(e, e2.view(-1))


def brute_decode(rows: list[list[int]], scales: list[float], n: int) -> list[float]:
    out = []
    for row, s in zip(rows, scales):
        for byte in row:
            for bit in range(8):
                out.append(s if byte >> bit & 1 else -s)
    return out[:n]


@st.composite
def coded_rows(draw):
    k = draw(st.integers(1, 6))
    c = draw(st.integers(0, 5))
    rows = [draw(st.lists(st.integers(0, 255), min_size=c, max_size=c)) for _ in range(k)]
    scales = draw(st.lists(st.floats(0, 1e6, width=32), min_size=k, max_size=k))
    return rows, scales


@given(coded_rows(), st.data(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_decode_matches_brute_force(coded, data, dtype):
    rows, scales = coded
    k, c = len(rows), len(rows[0])
    n = data.draw(st.integers(0, 8 * k * c))
    bits = torch.tensor(rows, dtype=torch.uint8).view(k, c)
    got = scaled_sign_decode(bits, torch.tensor(scales), n, dtype)
    assert got.dtype == dtype and got.shape == (n,)
    expected = torch.tensor(brute_decode(rows, scales, n), dtype=torch.float32).to(dtype)
    assert torch.equal(got, expected)
    if k == 1:  # one chunk: 1-D bits and a 0-d scale
        assert torch.equal(scaled_sign_decode(bits.view(-1), torch.tensor(scales[0]), n, dtype), expected)


@given(coded_rows())
def test_mean_matches_brute_force_in_rank_order(coded):
    rows, scales = coded
    k, c = len(rows), len(rows[0])
    got = scaled_sign_mean(torch.tensor(rows, dtype=torch.uint8).view(k, c), torch.tensor(scales))
    assert got.dtype == torch.float32 and got.shape == (8 * c,)
    weights = [f32(s / k) for s in scales]
    decoded = [brute_decode([row], [w], 8 * c) for row, w in zip(rows, weights)]
    expected = []
    for i in range(8 * c):
        acc = decoded[0][i]
        for r in range(1, k):
            acc = f32(acc + decoded[r][i])
        expected.append(acc)
    assert got.tolist() == expected


def test_compress_then_decode_gives_scale_times_sign():
    x = torch.randn(1001)
    e = torch.randn(1001) * 0.1
    v = x + e
    bits, scale = scaled_sign_compress(x, e)
    got = scaled_sign_decode(bits, scale, 1001)
    assert torch.equal(got, torch.where(v >= 0, scale, -scale))
    assert torch.equal(e, v - got)


def test_bad_inputs_name_the_argument():
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        scaled_sign_compress(torch.ones(3, dtype=torch.int32), torch.zeros(3))
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        scaled_sign_compress([1.0, 2.0], torch.zeros(2))
    with pytest.raises(TypeError, match="error must be float32"):
        scaled_sign_compress(torch.ones(3), torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"error must hold x.numel\(\) = 3 elements, got 4"):
        scaled_sign_compress(torch.ones(3), torch.zeros(4))
    with pytest.raises(ValueError, match="error must be contiguous"):
        scaled_sign_compress(torch.ones(3), torch.zeros(6)[::2])
    with pytest.raises(ValueError, match=r"nbytes must be an int of at least ceil\(n / 8\) = 2"):
        scaled_sign_compress(torch.ones(9), torch.zeros(9), nbytes=1)
    with pytest.raises(TypeError, match="bits must be"):
        scaled_sign_decode(torch.zeros(2, dtype=torch.int32), torch.ones(1), 8)
    with pytest.raises(ValueError, match="2 rows of bits need as many scales, got 3"):
        scaled_sign_mean(torch.zeros(2, 1, dtype=torch.uint8), torch.ones(3))
    with pytest.raises(ValueError, match="cannot decode n=17"):
        scaled_sign_decode(torch.zeros(2, dtype=torch.uint8), torch.ones(1), 17)
