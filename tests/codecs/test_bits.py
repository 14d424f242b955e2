import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit_strategy.codecs import bits

LANES = st.sampled_from(bits.LANE_BITS)


@st.composite
def codes_for_lane(draw, max_len=200):
    b = draw(LANES)
    cap = bits.lane(b).capacity
    values = draw(st.lists(st.integers(0, cap), min_size=0, max_size=max_len))
    return b, torch.tensor(values, dtype=torch.int64)


@given(codes_for_lane())
def test_pack_unpack_round_trip(case):
    b, codes = case
    spec = bits.lane(b)
    words = bits.pack(codes, b)
    assert words.dtype == spec.word_dtype
    assert words.numel() == spec.words_for(codes.numel())
    assert words.numel() * spec.word_bytes == spec.packed_bytes(codes.numel())
    assert torch.equal(bits.unpack(words, b, codes.numel()).long(), codes)


def _word_sum(word_list, spec):
    """Sum packed words the way a SUM allreduce does: uint8 wraps modulo 256."""
    total = torch.stack([w.long() for w in word_list]).sum(0)
    if spec.word_dtype == torch.uint8:
        return (total % 256).to(torch.uint8)
    assert total.numel() == 0 or int(total.max()) <= 2**31 - 1, "an int32 word must never overflow its sign"
    return total.to(torch.int32)


@given(data=st.data(), b=LANES, ranks=st.integers(1, 9), n=st.integers(0, 120))
def test_lane_sums_are_exact(data, b, ranks, n):
    spec = bits.lane(b)
    per_rank_max = spec.capacity // ranks
    codes = [
        torch.tensor(data.draw(st.lists(st.integers(0, per_rank_max), min_size=n, max_size=n)), dtype=torch.int64)
        for _ in range(ranks)
    ]
    summed_words = _word_sum([bits.pack(c, b) for c in codes], spec)
    expected = torch.stack(codes).sum(0) if n else torch.zeros(0, dtype=torch.int64)
    assert torch.equal(bits.unpack(summed_words, b, n).long(), expected)


def test_padding_is_zero_and_documented_layout():
    # element i sits at bit offset (i % k) * bits of word i // k (little-endian lanes)
    codes = torch.tensor([1, 2, 3], dtype=torch.uint8)
    words = bits.pack(codes, 2)
    assert words.tolist() == [1 | (2 << 2) | (3 << 4)]
    assert bits.pack(torch.tensor([1], dtype=torch.uint8), 1).tolist() == [1]
    assert bits.pack(torch.tensor([3, 5], dtype=torch.int32), 16).tolist() == [3 | (5 << 16)]


@pytest.mark.parametrize("b", [1, 2, 4, 8, 16, 32])
def test_pack_rejects_out_of_range_codes(b):
    cap = bits.lane(b).capacity
    with pytest.raises(ValueError, match=rf"\[0, {cap}\]"):
        bits.pack(torch.tensor([0, cap + 1], dtype=torch.int64), b)
    with pytest.raises(ValueError, match=r"\[0, "):
        bits.pack(torch.tensor([-1], dtype=torch.int64), b)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="lane_bits=3 is not supported"):
        bits.pack(torch.zeros(4, dtype=torch.uint8), 3)
    with pytest.raises(TypeError, match="integer tensor"):
        bits.pack(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="1-D"):
        bits.pack(torch.zeros(2, 2, dtype=torch.uint8), 1)
    with pytest.raises(TypeError, match="int32 words"):
        bits.unpack(torch.zeros(2, dtype=torch.uint8), 16, 2)
    with pytest.raises(ValueError, match="cannot unpack n=17"):
        bits.unpack(torch.zeros(2, dtype=torch.uint8), 1, 17)


@given(st.integers(0, 2**31 - 1))
def test_narrowest_lane_is_the_smallest_that_holds(v):
    spec = bits.narrowest_lane(v)
    assert spec.capacity >= v
    narrower = [b for b in bits.LANE_BITS if b < spec.bits]
    assert all(bits.lane(b).capacity < v for b in narrower)


def test_narrowest_lane_overflow():
    with pytest.raises(OverflowError, match="widest supported lane"):
        bits.narrowest_lane(2**31)


@settings(max_examples=25)
@given(codes_for_lane(max_len=50))
def test_pack_does_not_alias_input(case):
    b, codes = case
    source = codes.to(bits.lane(b).word_dtype)
    words = bits.pack(source, b)
    if words.numel():
        words.zero_()
    assert torch.equal(source.long(), codes)


def _shift_or_pack(codes: torch.Tensor, b: int) -> torch.Tensor:
    """The layout written out: code i at bit (i % k) * b of byte i // k."""
    k = 8 // b
    padded = torch.zeros(-(-codes.numel() // k) * k, dtype=torch.int64)
    padded[: codes.numel()] = codes.long()
    grid = padded.view(-1, k)
    return sum(grid[:, j] << (j * b) for j in range(k)).to(torch.uint8)


@pytest.mark.parametrize("b", [1, 2, 4])
def test_sub_byte_lanes_exhaustively(b):
    # every byte value, as the k codes that make it: pack gives it back, unpack splits it
    k = 8 // b
    byte = torch.arange(256)
    codes = ((byte.unsqueeze(1) >> (torch.arange(k) * b)) & ((1 << b) - 1)).reshape(-1)
    assert torch.equal(bits.pack(codes.to(torch.uint8), b), byte.to(torch.uint8))
    assert torch.equal(bits.unpack(byte.to(torch.uint8), b, codes.numel()).long(), codes)


@given(st.sampled_from([1, 2, 4]), st.data())
def test_sub_byte_pack_of_any_offset_length_and_dtype(b, data):
    cap = bits.lane(b).capacity
    values = data.draw(st.lists(st.integers(0, cap), max_size=70))
    offset = data.draw(st.integers(0, 9))
    dtype = data.draw(st.sampled_from([torch.uint8, torch.int8, torch.int32, torch.int64]))
    base = torch.tensor([0] * offset + values, dtype=dtype)
    codes = base[offset:]  # a view at an arbitrary storage offset
    expected = _shift_or_pack(codes, b)
    assert torch.equal(bits.pack(codes, b), expected)
    assert torch.equal(bits.pack(codes, b, validate=False), expected)
    assert torch.equal(base[offset:], torch.tensor(values, dtype=dtype))  # input untouched
    n = data.draw(st.integers(0, len(values)))
    assert torch.equal(bits.unpack(expected, b, n).long(), codes[:n].long())
