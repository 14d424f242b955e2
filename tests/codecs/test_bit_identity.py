"""The faster codecs give the same bits as the codecs before issue 23's pass-count work.

The oracle is a frozen copy of the old code (``tests/codecs/legacy``). Inputs cover the
sliced paths (lengths past :data:`~lowbit_strategy.codecs.streaming.SLICE`, not multiples
of it nor of 8), ties (exact zeros of both signs, values on the 2-bit threshold), all-zero
input, heavy tails, 16-bit and float64 inputs, and both torch thread counts the suite runs
with (a reduction's order depends on it: the new code must follow the old one there too).
"""

import math

import pytest
import torch

from lowbit_strategy.codecs import channel, lp, scaled_signs, signs
from lowbit_strategy.codecs.streaming import SLICE, row_slices
from tests.codecs.legacy import channel as old_channel
from tests.codecs.legacy import lp as old_lp
from tests.codecs.legacy import scaled_signs as old_scaled_signs
from tests.codecs.legacy import signs as old_signs

SLOW = pytest.mark.slow
#: lengths around the slice boundaries; the fast tier keeps one that spans two slices
LENGTHS = (1, 7, 1000, pytest.param(SLICE - 1, marks=SLOW), SLICE + 1, pytest.param(2 * SLICE + 13, marks=SLOW))


@pytest.fixture(params=[1, pytest.param(2, marks=SLOW)], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _vector(n: int, kind: str, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + n)
    x = torch.randn(n, generator=g)
    if kind == "zeros":  # ties: +0 and -0 scattered, a run of them
        x[torch.rand(n, generator=g) < 0.1] = 0.0
        x[torch.rand(n, generator=g) < 0.05] = -0.0
        x[: min(n, 40)] = 0.0
    elif kind == "heavy":  # Lion-like: tiny values, a few huge ones
        x = x * torch.rand(n, generator=g).pow(8) * 1e-6
        x[:: max(1, n // 7)] *= 1e9
    elif kind == "allzero":
        x.zero_()
    elif kind == "halves":  # many values on rounding ties after scaling
        x = torch.randint(-40, 40, (n,), generator=g).float() / 4
    return x


KINDS = ("randn", "zeros", "heavy", "allzero", "halves")


def _same(a, b):
    if isinstance(a, tuple):
        assert len(a) == len(b)
        for u, v in zip(a, b):
            _same(u, v)
        return
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype.is_floating_point:  # bit for bit: -0.0 against +0.0 and NaN payloads count
        a, b = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    assert torch.equal(a, b)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", KINDS)
def test_lp_quantize(threads, n, kind):
    x = _vector(n, kind)
    # p = 0 and 2 share the sliced quantizer; their means (float64) did not change
    for p in (1.0, math.inf) if n > 1000 else (0.0, 1.0, 2.0, math.inf):
        for levels in (1, 127, 300) if n <= 1000 else (127,):
            _same(lp.lp_quantize_levels(x, levels, p), old_lp.lp_quantize_levels(x, levels, p))
        _same(lp.lp_norm_mean(x, p), old_lp.lp_norm_mean(x, p))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_lp_quantize_other_dtypes(dtype):
    x = (
        _vector(2 * SLICE + 5, "heavy").to(dtype)
        if dtype == torch.float64
        else _vector(2 * SLICE + 5, "randn").to(dtype)
    )
    for p in (1.0, math.inf):
        _same(lp.lp_quantize_levels(x, 127, p), old_lp.lp_quantize_levels(x, 127, p))


def test_all_finite_agrees_with_the_exact_test():
    x = _vector(SLICE + 3, "randn")
    assert lp.all_finite(x)
    big = torch.full((10,), 3e38)  # finite values whose sum overflows: the exact test decides
    assert lp.all_finite(big) and not bool(torch.isfinite(big.sum()))
    for bad in (math.inf, -math.inf, math.nan):
        y = x.clone()
        y[SLICE] = bad
        assert not lp.all_finite(y)
    y = x.clone()
    y[0], y[1] = math.inf, -math.inf  # a NaN sum from two infinities
    assert not lp.all_finite(y)


SHAPES = (
    (1, 5),
    (3, 7),
    (2, SLICE + 1),
    pytest.param((5, SLICE // 2 + 3), marks=SLOW),
    (600, 1000),
    pytest.param((1000, 257), marks=SLOW),
    pytest.param((3, 2 * SLICE), marks=SLOW),
    pytest.param((SLICE + 5, 2), marks=SLOW),
)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}" if isinstance(s, tuple) else None)
@pytest.mark.parametrize("kind", ("randn", "zeros", "heavy", "allzero", "halves"))
def test_channel_encode(threads, shape, kind):
    rows = _vector(shape[0] * shape[1], kind).view(shape)
    if kind == "randn":  # some rows all zero, some values exactly on ±alpha
        rows[1:2] = 0.0
        alpha = 0.75 * rows[-1].abs().mean()
        rows[-1, :2] = torch.stack([alpha, -alpha])
    for bits in (1, 2):
        _same(channel.channel_encode(rows, bits), old_channel.channel_encode(rows, bits))
    _same(channel.channel_encode(rows.reshape(-1), 2), old_channel.channel_encode(rows.reshape(-1), 2))


def test_row_slices_cover_every_row_with_two_or_more():
    for rows, cols in ((1, 10), (2, 10**7), (3, 10**7), (10, 3), (1000, 257), (SLICE + 5, 2)):
        got = list(row_slices(rows, cols))
        assert got[0][0] == 0 and got[-1][1] == rows
        assert all(a[1] == b[0] for a, b in zip(got, got[1:]))
        assert all(hi - lo >= 2 for lo, hi in got) or rows == 1


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", ("randn", "zeros", "allzero"))
def test_sign_codes(threads, n, kind):
    x = _vector(n, kind)
    for step in (1, 2):
        _same(signs.sign_bits(x, step), old_signs.sign_bits(x, step))
        _same(signs.sign_bits_packed(x, step), old_signs.sign_bits_packed(x, step))
        _same(signs.sign_bits_packed(x.view(1, -1), step), old_signs.sign_bits_packed(x.view(1, -1), step))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", ("randn", "zeros", "heavy", "allzero"))
def test_scaled_sign_compress(threads, n, kind):
    x = _vector(n, kind)
    error = _vector(n, "randn", seed=1) * 0.1
    for extra in (0, 3):
        nbytes = -(-n // 8) + extra
        e_new, e_old = error.clone(), error.clone()
        _same(
            scaled_signs.scaled_sign_compress(x, e_new, nbytes=nbytes),
            old_scaled_signs.scaled_sign_compress(x, e_old, nbytes=nbytes),
        )
        _same(e_new, e_old)
    for block in (8, 1024) if n <= 1000 else (1024,):
        e_new, e_old = error.clone(), error.clone()
        _same(
            scaled_signs.scaled_sign_compress(x, e_new, block=block),
            old_scaled_signs.scaled_sign_compress(x, e_old, block=block),
        )
        _same(e_new, e_old)


@pytest.mark.parametrize("n", [SLICE + 1, pytest.param(3 * SLICE + 13, marks=SLOW)])
def test_scaled_sign_compress_blocks_in_chunks(threads, n):
    # the collective's layout: P chunks of c bytes, blocks restarting at each chunk, a block
    # size that divides the slice, one that does not, one longer than a slice; padding bytes
    x = _vector(n, "heavy")
    error = _vector(n, "randn", seed=1) * 0.1
    for block in (1000, 32768, 1 << 20):
        for p in (1, 3):
            c = -(-n // (8 * p))
            for chunk in (None, 8 * c):
                e_new, e_old = error.clone(), error.clone()
                _same(
                    scaled_signs.scaled_sign_compress(x, e_new, nbytes=p * c, block=block, chunk=chunk),
                    old_scaled_signs.scaled_sign_compress(x, e_old, nbytes=p * c, block=block, chunk=chunk),
                )
                _same(e_new, e_old)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_scaled_sign_compress_other_dtypes(dtype):
    n = 2 * SLICE + 9
    x = _vector(n, "zeros").to(dtype)
    e_new, e_old = torch.zeros(n), torch.zeros(n)
    _same(scaled_signs.scaled_sign_compress(x, e_new), old_scaled_signs.scaled_sign_compress(x, e_old))
    _same(e_new, e_old)


@pytest.mark.parametrize("n", (1000, 4096, pytest.param(SLICE + 1, marks=SLOW)))
def test_turboquant_given_scale_unchanged_and_rms_close(n):
    """TurboQuant's RMS rule is new (fold in halves, issue 23): with a given scale the codes
    are the old ones bit for bit; the RMS scales stay within a few ulps of the old tree's."""
    from lowbit_strategy.codecs import TurboQuantCodec
    from lowbit_strategy.codecs.turboquant_torch import group_rms
    from tests.codecs.legacy import turboquant_torch as old_tq

    x = _vector(n, "heavy")
    codec = TurboQuantCodec(4, seed=3, block=256, backend="torch")
    tables = codec._tables(x.device)[1]
    for scale in (torch.tensor([0.5]), torch.rand(-(-n // 256)) + 0.1):
        new = codec.encode(x, scale=scale)
        old = old_tq.encode(x, codec.signs(n, x.device), scale, block=256, midpoints=tables, bits=4, lane_bits=4)
        _same((new.codes, new.scales), old)
    y = torch.randn(n) * torch.logspace(-20, 20, n)
    new, old = group_rms(y, 256), old_tq.group_rms(y, 256)
    assert torch.allclose(new, old, rtol=4e-7 * 8, atol=0)


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("lane_bits", (1, 2, 4, 8, 16))
def test_pack_unpack(n, lane_bits):
    from lowbit_strategy.codecs import bits
    from tests.codecs.legacy import bits as old_bits

    capacity = bits.lane(lane_bits).capacity
    g = torch.Generator().manual_seed(n + lane_bits)
    codes = torch.randint(0, capacity + 1, (n,), generator=g).to(torch.uint8 if lane_bits <= 8 else torch.int32)
    codes[: min(n, 9)] = capacity  # all ones in the first words
    words = bits.pack(codes, lane_bits)
    _same(words, old_bits.pack(codes, lane_bits))
    for m in {n, max(0, n - 1)}:
        _same(bits.unpack(words, lane_bits, m), old_bits.unpack(words, lane_bits, m))


@pytest.mark.parametrize("n", (1000, 2 * SLICE + 700))
@pytest.mark.parametrize("block", (2, 64, 1024))
def test_hadamard_and_level_index(threads, n, block):
    from lowbit_strategy.codecs import lloyd_max_codebook
    from lowbit_strategy.codecs.hadamard import blocked_fwht, blocked_fwht_rows
    from lowbit_strategy.codecs.turboquant_torch import level_index
    from tests.codecs.legacy import hadamard as old_hadamard
    from tests.codecs.legacy import turboquant_torch as old_tq

    x = _vector(n, "heavy")
    _same(blocked_fwht(x, block), old_hadamard._blocked_fwht(x, block))
    rows = x[: n // 2 * 2].view(2, -1)
    _same(blocked_fwht_rows(rows, block), old_hadamard.blocked_fwht_rows(rows, block))
    for bits in (2, 3, 4, 5):
        levels = lloyd_max_codebook(bits)
        mids = (levels[:-1] + levels[1:]) / 2
        z = _vector(n, "randn") * 1.5
        z[::97] = mids[torch.arange(z[::97].numel()) % mids.numel()]  # exactly on midpoints: ties
        _same(level_index(z, mids, bits), old_tq.level_index(z, mids, bits))


def test_sliced_paths_take_tensors_that_require_grad():
    """The sliced paths write into buffers with out=, which autograd refuses: they detach."""
    x = _vector(SLICE + 11, "randn").requires_grad_()  # a multiple of 3: rows of 3 below
    _same(lp.lp_quantize(x, 8, 1), old_lp.lp_quantize(x.detach(), 8, 1))
    for bits in (1, 2):
        codes, scales = channel.channel_encode(x.view(-1, 3), bits)
        _same((codes, scales.detach()), old_channel.channel_encode(x.detach().view(-1, 3), bits))
    _same(signs.sign_bits_packed(x, 1), old_signs.sign_bits_packed(x.detach(), 1))
