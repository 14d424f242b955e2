import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit_strategy.codecs import bits, majority_bits, tie_is_positive
from lowbit_strategy.codecs.votes import majority_threshold


def _brute_majority(words: torch.Tensor, step: int) -> torch.Tensor:
    """The definition: unpack every vote, count the +1s, compare with P, pack."""
    p, c = words.shape
    ups = bits.unpack(words.reshape(-1), 1, 8 * c * p).view(p, 8 * c).long().sum(0)
    win = (2 * ups > p) | ((2 * ups == p) & tie_is_positive(step))
    return bits.pack(win.to(torch.uint8), 1)


@st.composite
def vote_rows(draw):
    p = draw(st.integers(1, 9))
    c = draw(st.integers(0, 40))
    # biased bytes (all-0 / all-1 rows included) so that every count 0..P shows up
    byte = st.sampled_from([0, 255]) | st.integers(0, 255)
    values = draw(st.lists(byte, min_size=p * c, max_size=p * c))
    return torch.tensor(values, dtype=torch.uint8).view(p, c)


@settings(max_examples=300)
@given(vote_rows(), st.integers(1, 10_000))
def test_majority_bits_matches_brute_force(words, step):
    got = majority_bits(words, step)
    assert got.dtype == torch.uint8 and got.shape == (words.shape[1],)
    assert torch.equal(got, _brute_majority(words, step))


@given(vote_rows(), st.integers(1, 4), st.integers(1, 6))
def test_majority_bits_of_strided_and_offset_rows(words, step, offset):
    p, c = words.shape
    big = torch.randint(0, 256, (p, c + offset + 3), dtype=torch.uint8)
    big[:, offset : offset + c] = words
    assert torch.equal(majority_bits(big[:, offset : offset + c], step), _brute_majority(words, step))


@pytest.mark.parametrize("p", range(1, 12))
def test_every_count_and_both_tie_parities(p):
    # element i of the C*8 sees i % (P+1) up-votes: rows r vote +1 iff r < count
    n = 8 * 64
    counts = torch.arange(n) % (p + 1)
    rows = torch.stack([bits.pack((counts > r).to(torch.uint8), 1) for r in range(p)])
    for step in (1, 2):
        expected = (2 * counts > p) | ((2 * counts == p) & tie_is_positive(step))
        got = bits.unpack(majority_bits(rows, step), 1, n).bool()
        assert torch.equal(got, expected)
        assert majority_threshold(p, step) == int(counts[expected].min())


def test_result_never_aliases_the_input():
    words = torch.randint(0, 256, (1, 16), dtype=torch.uint8)
    out = majority_bits(words, 1)
    out.zero_()
    assert words.any()


def test_bad_inputs():
    with pytest.raises(TypeError, match=r"\(P, C\) uint8"):
        majority_bits(torch.zeros(8, dtype=torch.uint8), 1)
    with pytest.raises(TypeError, match=r"\(P, C\) uint8"):
        majority_bits(torch.zeros(2, 8, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="at least one row"):
        majority_bits(torch.zeros(0, 8, dtype=torch.uint8), 1)
    with pytest.raises(TypeError, match="step must be an int"):
        majority_bits(torch.zeros(2, 8, dtype=torch.uint8), True)


@settings(max_examples=50)
@given(vote_rows(), st.integers(1, 4))
def test_majority_bits_across_slices(words, step):
    from lowbit_strategy.codecs import votes

    saved = votes._SLICE_WORDS
    votes._SLICE_WORDS = 2  # several slices of 16 bytes, the last one ragged
    try:
        assert torch.equal(majority_bits(words, step), _brute_majority(words, step))
    finally:
        votes._SLICE_WORDS = saved


@settings(max_examples=60)
@given(st.integers(1, 40), st.integers(0, 70), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_lane_counters_equal_the_adder_tree(p, c, step, seed):
    # the GPU method ("lanes": a few kernels whatever P) and the CPU one ("bitsliced") agree bit for bit
    words = torch.randint(0, 256, (p, c), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    want = majority_bits(words, step, method="bitsliced")
    assert torch.equal(majority_bits(words, step, method="lanes"), want)
    assert torch.equal(majority_bits(words, step), want)  # auto on the CPU


def test_lane_counters_at_their_row_limit_and_a_bad_method():
    from lowbit_strategy.codecs.votes import MAX_LANE_ROWS

    for p in (MAX_LANE_ROWS - 1, MAX_LANE_ROWS, MAX_LANE_ROWS + 3):  # beyond the limit: the adder tree
        words = torch.randint(0, 256, (p, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(p))
        assert torch.equal(majority_bits(words, 2, method="lanes"), majority_bits(words, 2, method="bitsliced"))
    with pytest.raises(ValueError, match="method must be one of"):
        majority_bits(torch.zeros(2, 3, dtype=torch.uint8), 1, method="fast")
