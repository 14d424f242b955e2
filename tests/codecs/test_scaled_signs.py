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
from tests.codecs.test_reduce import tree_sum


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
    # the ranks' pairwise order (codecs.reduce.rank_sum), one float32 rounding per addition
    expected = [tree_sum([decoded[r][i] for r in range(k)], f32) for i in range(8 * c)]
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


# ---- block scales ------------------------------------------------------------------------


def brute_block_spans(n: int, block: int, chunk: int | None, nbytes: int):
    """(row, block, lo, hi) of every block, written out: blocks restart at every chunk."""
    length = chunk if chunk is not None else n
    rows = 8 * nbytes // chunk if chunk is not None else 1
    per_row = -(-length // block) if chunk is not None or n else 0
    return [
        (r, b, r * length + b * block, min(r * length + (b + 1) * block, (r + 1) * length, n))
        for r in range(rows)
        for b in range(per_row)
    ]


BLOCKS = [8, 16, 24, 64, 1024]


@settings(max_examples=200)
@given(
    vectors,
    st.data(),
    st.sampled_from(BLOCKS),
    st.sampled_from([None, 8, 16, 24, 40]),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_block_compress_matches_brute_force(xs, data, block, chunk, dtype):
    n = len(xs)
    x = torch.tensor(xs, dtype=torch.float32).to(dtype)
    e = torch.tensor(data.draw(st.lists(values, min_size=n, max_size=n)), dtype=torch.float32)
    e_before = e.clone()
    nbytes = -(-n // 8)
    if chunk is not None:  # a whole number of chunks, sometimes one more of padding only
        nbytes = (-(-nbytes * 8 // chunk) + data.draw(st.integers(0, 1))) * chunk // 8
        nbytes = max(nbytes, chunk // 8)

    bits, scales = scaled_sign_compress(x, e, nbytes=nbytes, block=block, chunk=chunk)

    v, signs, packed, _ = brute_compress(x.float().tolist(), e_before.tolist(), nbytes)
    assert bits.tolist() == packed  # the signs do not depend on the scales
    spans = brute_block_spans(n, block, chunk, nbytes)
    if chunk is None:
        assert scales.shape == (-(-n // block),)
        grid = scales.view(1, -1)
    else:
        assert scales.shape == (8 * nbytes // chunk, -(-chunk // block))
        grid = scales
    assert scales.dtype == torch.float32
    expected = [0.0] * n
    for r, b, lo, hi in spans:
        s = grid[r, b].item()
        if lo >= hi:  # padding only
            assert s == 0.0
            continue
        block_v = torch.tensor(v[lo:hi])
        # the same float32 as this block's norm on its own (the collective's oracle relies on it)
        assert s == (torch.linalg.vector_norm(block_v) / math.sqrt(hi - lo)).item()
        assert s == pytest.approx(math.sqrt(sum(a * a for a in v[lo:hi]) / (hi - lo)), rel=(hi - lo + 2) * 2.0**-24)
        for i in range(lo, hi):
            expected[i] = f32(v[i] - s * signs[i])
    assert e.tolist() == expected
    # decoding gives s_b·sign back: the error is v minus exactly that
    rows = bits.view(-1, chunk // 8) if chunk is not None else bits
    decoded = scaled_sign_decode(rows, scales, n, block=block)
    assert decoded.tolist() == [grid[r, b].item() * signs[i] for r, b, lo, hi in spans for i in range(lo, hi)]


def test_block_none_keeps_one_0d_scale_and_a_block_covering_everything_gives_the_same_code():
    x, e1, e2 = torch.randn(100), torch.zeros(100), torch.zeros(100)
    bits1, scale = scaled_sign_compress(x, e1)
    bits2, scales = scaled_sign_compress(x, e2, block=104)
    assert scale.dim() == 0 and scales.shape == (1,)
    assert torch.equal(bits1, bits2) and torch.equal(scale, scales[0]) and torch.equal(e1, e2)
    assert torch.equal(scaled_sign_decode(bits1, scale, 100), scaled_sign_decode(bits2, scales, 100, block=104))


def test_block_scales_beat_one_scale_when_magnitudes_differ():
    """A vector whose halves differ 1000x in magnitude (two layers in one bucket): one scale
    is set by the large half and sends the small half ~1000x too large; a scale per half
    sends each half at its own size."""
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(512, generator=gen) * 1000, torch.randn(512, generator=gen)])
    e_one, e_blocks = torch.zeros(1024), torch.zeros(1024)
    scaled_sign_compress(x, e_one)
    _, scales = scaled_sign_compress(x, e_blocks, block=512)
    assert scales[0] > 500 * scales[1]
    # e = v - C[v]: the compression error, overall and on the small half
    assert e_blocks.norm() < 0.75 * e_one.norm()
    small = x[512:].norm()
    assert e_blocks[512:].norm() < small  # about 0.6·‖x_small‖
    assert e_one[512:].norm() > 300 * small  # the large scale, sent where it does not belong


@st.composite
def block_coded_rows(draw):
    k = draw(st.integers(1, 5))
    c = draw(st.integers(0, 9))
    block = draw(st.sampled_from([8, 16, 24, 64]))
    nb = -(-8 * c // block)
    rows = [draw(st.lists(st.integers(0, 255), min_size=c, max_size=c)) for _ in range(k)]
    scales = [draw(st.lists(st.floats(0, 1e6, width=32), min_size=nb, max_size=nb)) for _ in range(k)]
    return rows, scales, block


def _expand(scales_row: list[float], c: int, block: int) -> list[float]:
    """One scale per element of a row of c bytes: element j is in block j // block."""
    return [scales_row[j // block] for j in range(8 * c)]


def brute_decode_blocks(rows, scales, block, n):
    out = []
    for row, srow in zip(rows, scales):
        per = _expand(srow, len(row), block)
        bits_ = [byte >> bit & 1 for byte in row for bit in range(8)]
        out += [s if b else -s for s, b in zip(per, bits_)]
    return out[:n]


@given(block_coded_rows(), st.data(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_block_decode_matches_brute_force(coded, data, dtype):
    rows, scales, block = coded
    k, c = len(rows), len(rows[0])
    n = data.draw(st.integers(0, 8 * k * c))
    bits = torch.tensor(rows, dtype=torch.uint8).view(k, c)
    expected = torch.tensor(brute_decode_blocks(rows, scales, block, n), dtype=torch.float32).to(dtype)
    grid = torch.tensor(scales, dtype=torch.float32).view(k, -1)
    for s in (grid, grid.view(-1)):  # (k, nb) or flat
        got = scaled_sign_decode(bits, s, n, dtype, block=block)
        assert got.dtype == dtype and got.shape == (n,)
        assert torch.equal(got, expected)


@given(block_coded_rows())
def test_block_mean_matches_brute_force_in_rank_order(coded):
    rows, scales, block = coded
    k, c = len(rows), len(rows[0])
    got = scaled_sign_mean(
        torch.tensor(rows, dtype=torch.uint8).view(k, c),
        torch.tensor(scales, dtype=torch.float32).view(k, -1),
        block=block,
    )
    assert got.dtype == torch.float32 and got.shape == (8 * c,)
    decoded = [
        brute_decode_blocks([row], [[f32(s / k) for s in srow]], block, 8 * c) for row, srow in zip(rows, scales)
    ]
    expected = [tree_sum([decoded[r][i] for r in range(k)], f32) for i in range(8 * c)]  # rank_sum's order
    assert got.tolist() == expected


@pytest.mark.parametrize("block", [0, -8, 4, 12, 8.0, True, "8"])
def test_bad_block_names_block(block):
    match = "block must be None or a positive multiple of 8"
    with pytest.raises(ValueError, match=match):
        scaled_sign_compress(torch.ones(16), torch.zeros(16), block=block)
    with pytest.raises(ValueError, match=match):
        scaled_sign_decode(torch.zeros(2, dtype=torch.uint8), torch.ones(2), 16, block=block)
    with pytest.raises(ValueError, match=match):
        scaled_sign_mean(torch.zeros(1, 2, dtype=torch.uint8), torch.ones(2), block=block)


def test_bad_chunk_and_block_scale_counts():
    with pytest.raises(ValueError, match="chunk needs block"):
        scaled_sign_compress(torch.ones(16), torch.zeros(16), chunk=8)
    with pytest.raises(ValueError, match=r"chunk must be a positive multiple of 8 dividing 8 \* nbytes = 24"):
        scaled_sign_compress(torch.ones(16), torch.zeros(16), nbytes=3, block=8, chunk=16)
    with pytest.raises(ValueError, match=r"2 rows of 3 bytes need 2 x ceil\(24/block=16\) = 4 block scales, got 2"):
        scaled_sign_decode(torch.zeros(2, 3, dtype=torch.uint8), torch.ones(2), 48, block=16)
    with pytest.raises(ValueError, match="need 2 x"):
        scaled_sign_mean(torch.zeros(2, 3, dtype=torch.uint8), torch.ones(3), block=16)


@pytest.mark.parametrize("c, block", [(10_000, 65_536), (700, 64)])  # tables per block / ±1 times each byte's scale
def test_large_blocks_decode_and_mean_the_same_floats(c, block):
    """Blocks of 16384+ elements decode through a table per block, smaller ones through a
    ±1 gather times each byte's scale: both give the per-element formula's floats exactly
    (here with a partial last block: 80000 = 65536 + 14464)."""
    gen = torch.Generator().manual_seed(1)
    k, nb = 3, -(-8 * c // block)
    rows = torch.randint(0, 256, (k, c), generator=gen, dtype=torch.uint8)
    scales = torch.rand(k, nb, generator=gen) * 10
    signs = ((rows.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(k, 8 * c).float() * 2 - 1
    per_element = scales.repeat_interleave(block, dim=1)[:, : 8 * c]
    for dtype in (torch.float32, torch.bfloat16):
        expected = (per_element * signs).view(-1).to(dtype)
        assert torch.equal(scaled_sign_decode(rows, scales, k * 8 * c - 5, dtype, block=block), expected[:-5])
    acc = (per_element[0] / k) * signs[0]
    for r in range(1, k):
        acc = acc + (per_element[r] / k) * signs[r]
    assert torch.equal(scaled_sign_mean(rows, scales, block=block), acc)


@pytest.mark.parametrize("block", [None, 16, 16384])
@pytest.mark.parametrize("n_cut", [0, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_into_out_is_the_same_floats(block, n_cut, dtype):
    # the three gathers (one table per row; ±1 times each byte's block scale; one table per
    # block) write whole bytes in place and the partial last byte apart
    k, c = 3, 4096
    bits = torch.randint(0, 256, (k, c), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    nb = 1 if block is None else -(-8 * c // block)
    scales = torch.rand(k, nb, generator=torch.Generator().manual_seed(2)).view(k if block is None else (k, nb))
    n = 8 * k * c - n_cut
    want = scaled_sign_decode(bits, scales, n, dtype, block)
    out = torch.full((n,), float("nan"), dtype=dtype)
    got = scaled_sign_decode(bits, scales, n, dtype, block, out=out)
    assert got is out and torch.equal(out, want)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        scaled_sign_decode(bits, scales, n, dtype, block, out=torch.empty(n + 1, dtype=dtype))


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("block", [None, 16384])
def test_mean_of_many_bytes_is_the_whole_tensor_sum(k, block):
    # past a slice the mean runs slice by slice on the CPU: the same floats as one rank_sum
    from lowbit_strategy.codecs.reduce import rank_sum
    from lowbit_strategy.codecs.streaming import SLICE

    c = SLICE // 4 + 13
    bits = torch.randint(0, 256, (k, c), dtype=torch.uint8, generator=torch.Generator().manual_seed(k))
    nb = 1 if block is None else -(-8 * c // block)
    scales = torch.rand(k, nb, generator=torch.Generator().manual_seed(7)) * 3
    scales = scales.view(k) if block is None else scales
    decoded = torch.stack([scaled_sign_decode(bits[r], scales[r].reshape(-1), 8 * c, block=block) for r in range(k)])
    want = rank_sum(decoded / k) if block is None else None
    got = scaled_sign_mean(bits, scales, block)
    if want is not None:
        assert torch.equal(got, want)
    # against the unsliced form: the whole-tensor gather and one rank_sum
    import lowbit_strategy.codecs.scaled_signs_decode as ss

    old, ss.SLICE = ss.SLICE, 1 << 40
    try:
        assert torch.equal(got, scaled_sign_mean(bits, scales, block))
    finally:
        ss.SLICE = old
