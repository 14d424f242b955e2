"""The blockwise symmetric codec of the quantized FSDP reduce-scatter: error bounds, sizes,
the 2-bit dither's unbiasedness, non-finite blocks."""
import pytest
import torch

from lowbit_strategy.codecs import blockwise as bw


def _heavy(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = torch.distributions.StudentT(torch.tensor(2.0))
    torch.manual_seed(seed)
    return t.sample(shape) * torch.rand(shape, generator=gen)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("n", [1, 255, 256, 1000])
def test_each_element_is_within_one_step_of_its_block_scale(bits, n):
    x = _heavy((3, n))
    codes, scales = bw.encode(x, bits, salt=7)
    nb = bw.blocks(n)
    assert codes.dtype == torch.uint8 and codes.shape == (3, nb * bw.BLOCK * bits // 8)
    assert scales.shape == (3, nb) and scales.dtype == torch.float32
    assert bw.row_bytes(n, bits) == (codes.shape[1], scales.shape[1] * 4)
    y = bw.decode(codes, scales, bits, n)
    assert y.shape == x.shape
    pad = torch.nn.functional.pad(x, (0, nb * bw.BLOCK - n)).view(3, nb, bw.BLOCK)
    s = pad.abs().amax(2) / bw.LEVELS[bits]
    assert torch.equal(scales, s)
    step = s.repeat_interleave(bw.BLOCK, 1)[:, :n]
    err = (y - x).abs()
    # nearest: half a step; stochastic (2 bits): under one step
    bound = step * (1.0 if bits == 2 else 0.5) * (1 + 1e-6)
    assert (err <= bound).all(), (err - bound).max()
    # the block maximum is exact (code +-Q times its scale)
    assert torch.allclose(y.abs().amax(1), x.abs().amax(1), rtol=1e-6)


def test_two_bits_are_unbiased_over_dithers_and_nearest_rounding_is_not():
    x = torch.full((1, bw.BLOCK), 0.3)
    x[0, 0] = 1.0  # scale 1: the others sit between codes 0 and 1
    means = torch.stack([bw.decode(*bw.encode(x, 2, salt=s), 2, bw.BLOCK) for s in range(2000)]).mean(0)
    assert (means[0, 1:] - 0.3).abs().max() < 0.05
    assert abs(means[0, 1:].mean().item() - 0.3) < 0.005
    # 4 bits round to nearest: 0.3 * 7 = 2.1 -> 2 / 7, the same every time
    four = bw.decode(*bw.encode(x, 4), 4, bw.BLOCK)
    assert torch.allclose(four[0, 1:], torch.full((bw.BLOCK - 1,), 2 / 7))


def test_dither_is_uniform_deterministic_and_salted():
    x = torch.randn(200_000)
    u = bw.dither(x, 3)
    assert torch.equal(u, bw.dither(x, 3))
    assert not torch.equal(u, bw.dither(x, 4))
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.std().item() - (1 / 12) ** 0.5) < 0.005
    hist = torch.histc(u, bins=16, min=0, max=1) / u.numel()
    assert (hist - 1 / 16).abs().max() < 0.005
    # equal values at other positions draw other numbers
    same = bw.dither(torch.ones(10_000), 0)
    assert same.unique().numel() > 9_900


def test_a_non_finite_block_decodes_to_nan_and_leaves_the_others_alone():
    x = torch.randn(2, 3 * bw.BLOCK)
    x[0, 5] = float("inf")
    x[1, 2 * bw.BLOCK + 1] = float("nan")
    for bits in (8, 4, 2):
        y = bw.decode(*bw.encode(x, bits), bits, x.shape[1])
        assert y[0, : bw.BLOCK].isnan().all() and y[1, 2 * bw.BLOCK :].isnan().all()
        assert y[0, bw.BLOCK :].isfinite().all() and y[1, : 2 * bw.BLOCK].isfinite().all()


def test_zero_blocks_and_bf16_rows():
    x = torch.zeros(2, 300)
    assert torch.equal(bw.decode(*bw.encode(x, 4), 4, 300), x)
    b = _heavy((2, 300)).to(torch.bfloat16)
    y = bw.decode(*bw.encode(b, 8), 8, 300)
    assert y.dtype == torch.float32
    assert torch.equal(bw.encode(b, 8)[0], bw.encode(b.float(), 8)[0])
