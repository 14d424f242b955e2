"""Lloyd–Max codebooks for N(0, 1) against the known values of Max's table."""
import pytest
import torch

from lowbit_strategy.codecs import lloyd_max_codebook, lloyd_max_mse
from lowbit_strategy.codecs import lloyd_max, lloyd_max_table
from lowbit_strategy.codecs.lloyd_max import CODEBOOK_BITS, check_bits

FAST_BITS = [2, 3, 4, 5, 6]


@pytest.mark.parametrize("bits", CODEBOOK_BITS)
def test_sorted_symmetric_float32(bits):
    c = lloyd_max_codebook(bits)
    assert c.dtype == torch.float32 and c.shape == (2**bits,)
    assert torch.all(c[1:] > c[:-1])
    assert torch.equal(c, -c.flip(0))


def test_two_bit_levels_match_max():
    c = lloyd_max_codebook(2)
    assert c.tolist() == pytest.approx([-1.510, -0.4528, 0.4528, 1.510], abs=5e-4)
    assert lloyd_max_mse(c) == pytest.approx(0.1175, abs=1e-4)


def test_four_bit_mse_matches_max():
    # Max (1960) tabulates 0.009497; the exact fixed point (same levels to 4 digits) is 0.009501
    c = lloyd_max_codebook(4)
    assert lloyd_max_mse(c) == pytest.approx(0.009497, abs=1e-5)
    assert c[8:].tolist() == pytest.approx([0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733], abs=5e-4)


@pytest.mark.parametrize("bits", FAST_BITS)
def test_fixed_point_levels_are_centroids(bits):
    # perturbing any level raises the MSE: the returned levels are a (local) optimum
    c = lloyd_max_codebook(bits).double()
    base = lloyd_max_mse(c)
    for i in (0, len(c) // 2, len(c) - 1):
        for d in (1e-3, -1e-3):
            p = c.clone()
            p[i] += d
            assert lloyd_max_mse(p) > base


def test_mse_decreases_about_four_fold_per_bit():
    mses = [lloyd_max_mse(lloyd_max_codebook(b)) for b in FAST_BITS]
    for a, b in zip(mses, mses[1:]):
        assert 3.0 < a / b < 4.5


def test_callers_cannot_corrupt_the_cache():
    c = lloyd_max_codebook(4)
    c.zero_()
    assert lloyd_max_codebook(4)[-1].item() == pytest.approx(2.7326, abs=1e-4)


@pytest.mark.parametrize("bad", [1, 9, 0, -4, 4.0, "4", True, None])
def test_bad_bits_raise(bad):
    with pytest.raises(ValueError, match="bits"):
        lloyd_max_codebook(bad)


def test_check_bits_is_the_codebooks_range():
    """The one bits rule of the codec, optimizer and layers: exactly the widths with a codebook."""
    assert [b for b in range(-1, 12) if _accepts(b)] == list(CODEBOOK_BITS) == [2, 3, 4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match=r"^Who: bits must be an int in \[2, 8\] \(why\), got 4.0$"):
        check_bits("Who", 4.0, what=" (why)")


def _accepts(bits) -> bool:
    try:
        return check_bits("t", bits) == bits
    except ValueError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("bits", [7, 8])
def test_wide_codebooks(bits):
    c = lloyd_max_codebook(bits)
    assert torch.all(c[1:] > c[:-1]) and torch.equal(c, -c.flip(0))
    ratio = lloyd_max_mse(lloyd_max_codebook(bits - 1)) / lloyd_max_mse(c)
    assert 3.5 < ratio < 4.2


@pytest.mark.parametrize("bits", [2, 3, 4, 5])  # the solver takes milliseconds up to 5 bits
def test_table_holds_the_solvers_levels(bits):
    assert lloyd_max_table.HALF_LEVELS[bits] == lloyd_max._half_levels(bits)  # float64, exact


@pytest.mark.slow
def test_table_file_is_what_the_solver_writes():
    # every width (8 bits: ~100,000 rounds, seconds): the committed table is the solver's output
    path = lloyd_max.__file__.replace("lloyd_max.py", "lloyd_max_table.py")
    with open(path) as f:
        assert f.read() == lloyd_max.table_source()


def test_codebook_is_the_table_rounded_once_to_float32():
    for bits in CODEBOOK_BITS:
        half = torch.tensor(lloyd_max_table.HALF_LEVELS[bits], dtype=torch.float64).float()
        assert torch.equal(lloyd_max_codebook(bits), torch.cat([-half.flip(0), half]))
