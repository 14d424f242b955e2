import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from lowbit_strategy.codecs import bits, channel_decode, channel_encode
from lowbit_strategy.codecs.channel import TERNARY_MINUS, TERNARY_PLUS, TERNARY_ZERO, channel_encode_many
from lowbit_strategy.codecs.streaming import SLICE

matrices = st.tuples(st.integers(1, 6), st.integers(1, 12)).flatmap(
    lambda shape: arrays(np.float32, shape, elements=st.floats(-100, 100, width=32))
)


def _brute_2bit(row):
    """BitDP Eq. 7 and Eq. 4 written out element by element."""
    alpha = 0.75 * np.mean(np.abs(row.astype(np.float64)))
    q = np.array([1 if v >= alpha else (-1 if v < -alpha else 0) for v in row.astype(np.float64)])
    kept = np.abs(row[q != 0].astype(np.float64))
    return q, (kept.mean() if kept.size else 0.0)


@given(matrices)
def test_one_bit_codes_and_scales(g):
    codes, scales = channel_encode(torch.from_numpy(g), 1)
    q = codes.reshape(g.shape).numpy()
    assert np.array_equal(q, (g >= 0).astype(np.uint8))  # Eq. 5: zero is +1
    np.testing.assert_allclose(scales.numpy(), np.abs(g).mean(axis=1), rtol=1e-5, atol=1e-6)


@given(matrices)
def test_two_bit_matches_brute_force(g):
    codes, scales = channel_encode(torch.from_numpy(g), 2)
    q = codes.reshape(g.shape).numpy()
    for i, row in enumerate(g):
        expected_q, expected_s = _brute_2bit(row)
        got_q = np.where(q[i] == TERNARY_PLUS, 1, np.where(q[i] == TERNARY_MINUS, -1, 0))
        # float32 vs float64 may disagree only for an entry sitting exactly on the threshold
        alpha = 0.75 * np.mean(np.abs(row.astype(np.float64)))
        on_edge = np.isclose(np.abs(row), alpha, rtol=1e-5)
        assert np.array_equal(got_q[~on_edge], expected_q[~on_edge])
        if not on_edge.any():
            assert scales[i].item() == pytest.approx(expected_s, rel=1e-5, abs=1e-6)
    assert set(np.unique(q).tolist()) <= {TERNARY_ZERO, TERNARY_PLUS, TERNARY_MINUS}


@settings(max_examples=50)
@given(matrices, st.sampled_from([1, 2]))
def test_scale_is_mse_optimal_for_its_codes(g, b):
    t = torch.from_numpy(g).double()
    codes, scales = channel_encode(torch.from_numpy(g), b)
    unit = channel_decode(codes, torch.ones_like(scales), b).double()
    for i in range(g.shape[0]):
        err = lambda s: float(((t[i] - s * unit[i]) ** 2).sum())  # noqa: E731
        s = float(scales[i])
        for ds in (1e-3, -1e-3):
            assert err(s) <= err(s + ds * max(abs(s), 1.0)) + 1e-6 * max(1.0, err(s))


@given(matrices, st.sampled_from([1, 2]))
def test_codes_pack_into_lanes_and_decode_shape(g, b):
    codes, scales = channel_encode(torch.from_numpy(g), b)
    words = bits.pack(codes, b)
    assert torch.equal(bits.unpack(words, b, codes.numel()), codes)
    assert channel_decode(codes, scales, b).shape == g.shape


def test_all_zero_row_is_safe():
    g = torch.zeros(2, 5)
    g[1] = torch.tensor([1.0, -2.0, 0.0, 3.0, 0.5])
    for b in (1, 2):
        codes, scales = channel_encode(g, b)
        assert scales[0] == 0
        assert channel_decode(codes, scales, b)[0].eq(0).all()


def test_threshold_is_optimal_for_triangular_distribution():
    """BitDP App. B: for a triangular |g| density the objective (Σ_{|g|>α}|g|)² / |Ω_α| peaks
    at α = h/4 = ¾·E|g|, which is the threshold the codec uses."""
    rng = np.random.default_rng(0)
    h = 2.0
    g = rng.triangular(-h, 0.0, h, size=400_000)
    a = np.sort(np.abs(g))
    suffix = np.cumsum(a[::-1])[::-1]  # Σ_{j >= i} a_j
    count = len(a) - np.arange(len(a))
    objective = suffix**2 / count
    alpha_best = a[np.argmax(objective)]
    assert alpha_best == pytest.approx(h / 4, rel=0.03)
    codes, _ = channel_encode(torch.from_numpy(g[None, :].astype(np.float32)), 2)
    kept_fraction = float((codes != TERNARY_ZERO).float().mean())
    expected_kept = float((np.abs(g) > 0.75 * np.abs(g).mean()).mean())
    assert kept_fraction == pytest.approx(expected_kept, abs=1e-4)
    assert 0.75 * np.abs(g).mean() == pytest.approx(h / 4, rel=0.01)


def test_bad_inputs():
    with pytest.raises(ValueError, match="BitDP bits must be 1 or 2"):
        channel_encode(torch.ones(2, 2), 4)
    with pytest.raises(ValueError, match="NaN or Inf"):
        channel_encode(torch.tensor([[1.0, float("nan")]]), 2)
    with pytest.raises(TypeError, match="floating-point"):
        channel_encode(torch.ones(2, 2, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="non-empty"):
        channel_encode(torch.ones(0, 3), 1)
    with pytest.raises(ValueError, match="do not split"):
        channel_decode(torch.zeros(5, dtype=torch.uint8), torch.ones(2), 1)


def _textbook_encode(g: torch.Tensor, b: int):
    """channel_encode written plainly with bool masks (the form the codec must equal bit for bit)."""
    rows = g.reshape(g.shape[0], -1).float()
    mag = rows.abs()
    mean_abs = mag.mean(dim=1)
    if b == 1:
        return (rows >= 0).to(torch.uint8).reshape(-1), mean_abs
    alpha = (0.75 * mean_abs).unsqueeze(1)
    plus, minus = rows >= alpha, rows < -alpha
    kept = plus | minus
    count = kept.sum(dim=1)
    total = (mag * kept).sum(dim=1)
    scales = torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))
    codes = plus.to(torch.uint8) * TERNARY_PLUS + minus.to(torch.uint8) * TERNARY_MINUS
    return codes.reshape(-1), scales


@given(matrices, st.sampled_from([1, 2]))
def test_codes_and_scales_equal_the_textbook_form_bitwise(g, b):
    t = torch.from_numpy(g)
    for got, expected in zip(channel_encode(t, b), _textbook_encode(t, b)):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.uint8, 4: torch.int32}[a.element_size()]
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize("b", [1, 2])
def test_encode_many_is_each_matrix_encoded_alone_bitwise(b):
    g = torch.Generator().manual_seed(b)
    shapes = [(6, 40), (3, 40), (1, 40), (4, 40), (5, 17), (7, 17), (2, 40), (9,), (700, 400), (2, 400), (3, 4, 10)]
    mats = [torch.randn(s, generator=g) * torch.rand(s[0], *[1] * (len(s) - 1), generator=g) for s in shapes]
    mats[1][0].zero_()  # a row with nothing kept: scale 0
    mats.append(torch.randn(30, 16, generator=g).t())  # a transposed view: rows of 30
    mats.append(torch.randn(5, 30, generator=g, dtype=torch.float64))
    got = channel_encode_many(mats, b, decode=True)
    assert len(got) == len(mats)
    assert 700 * 400 > SLICE  # the stack of the (700, 400) run is encoded in slices, alone it is too
    for m, (codes, scales, dec) in zip(mats, got):
        want_c, want_s = channel_encode(m, b)
        assert _same(codes, want_c) and _same(scales, want_s)
        assert _same(dec, channel_decode(want_c, want_s, b))
    assert all(d is None for _, _, d in channel_encode_many(mats, b))


def test_encode_many_runs_about_the_calls_of_one_matrix():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    mats = [torch.randn(16, 64) for _ in range(12)]
    with Count():
        channel_encode_many(mats[:1], 2, decode=True, validate=False)
    one, Count.n = Count.n, 0
    with Count():
        channel_encode_many(mats, 2, decode=True, validate=False)
    # 12 matrices: the stack's calls plus a few views per matrix, not 12 encodes
    assert Count.n < 3 * one, (Count.n, one)
    Count.n = 0
    with Count():
        for m in mats:
            c, s = channel_encode(m, 2, validate=False)
            channel_decode(c, s, 2)
    assert Count.n > 9 * one


def test_encode_many_rejects_what_encode_rejects():
    with pytest.raises(ValueError, match="NaN or Inf"):
        channel_encode_many([torch.ones(2, 3), torch.tensor([[1.0, float("nan"), 0.0]] * 2)], 2)
    with pytest.raises(ValueError, match="bits"):
        channel_encode_many([torch.ones(2, 3)], 3)


def test_encode_many_reads_back_to_back_matrices_in_place():
    # a flat buffer's consecutive matrices (a bucket, the server's chunk) are one view, not a copy
    flat = torch.randn(6 * 40 + 4 * 40 + 3 * 8, generator=torch.Generator().manual_seed(3))
    mats = [flat[:240].view(6, 40), flat[240:400].view(4, 40), flat[400:].view(3, 8)]
    got = channel_encode_many(mats, 2, decode=True)
    for m, (codes, scales, dec) in zip(mats, got):
        want_c, want_s = channel_encode(m, 2)
        assert _same(codes, want_c) and _same(scales, want_s) and _same(dec, channel_decode(want_c, want_s, 2))
    gap = [flat[:240].view(6, 40), flat[280:400].view(3, 40)]  # not adjacent: concatenated
    for m, (codes, scales, _) in zip(gap, channel_encode_many(gap, 2)):
        want_c, want_s = channel_encode(m, 2)
        assert _same(codes, want_c) and _same(scales, want_s)
