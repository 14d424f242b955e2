"""The blocked randomized Hadamard rotation against a dense Sylvester matrix."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit_strategy.codecs import hadamard_rotate, hadamard_signs, hadamard_unrotate
from lowbit_strategy.codecs.hadamard import tail_pieces


def sylvester(k: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < k:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(k)


def dense_rotate(x: torch.Tensor, signs: torch.Tensor, block: int) -> torch.Tensor:
    """Brute force: the block-diagonal matrix of normalized Sylvester matrices (tail in
    decreasing power-of-two pieces) times D x, in float64."""
    v = x.double().reshape(-1) * signs.double()
    n = v.numel()
    sizes = [block] * (n // block) + tail_pieces(n % block)
    m = torch.block_diag(*[sylvester(s) for s in sizes]) if sizes else torch.zeros(0, 0, dtype=torch.float64)
    return m @ v


@settings(max_examples=60)
@given(st.integers(0, 70), st.sampled_from([2, 4, 8, 16]), st.integers(0, 2**31))
def test_matches_dense_sylvester(n, block, seed):
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed % 1000))
    y = hadamard_rotate(x, seed, block)
    assert y.dtype == torch.float32 and y.shape == (n,)
    ref = dense_rotate(x, hadamard_signs(n, seed), block)
    assert torch.allclose(y.double(), ref, atol=1e-5)
    back = hadamard_unrotate(y, seed, block)
    assert back.shape == (n,)
    assert torch.allclose(back, x, atol=1e-5)


def test_tail_pieces():
    assert tail_pieces(700) == [512, 128, 32, 16, 8, 4]
    assert tail_pieces(0) == [] and tail_pieces(1) == [1]


@pytest.mark.parametrize("shape", [(4096,), (3, 1000), (5000,), (1,), (1023,)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_norm_preserved_and_inverse(shape, dtype):
    x = torch.randn(shape).to(dtype)
    y = hadamard_rotate(x, 3)
    assert y.shape == (x.numel(),) and y.dtype == torch.float32
    xf = x.float().reshape(-1)
    assert torch.linalg.vector_norm(y).item() == pytest.approx(torch.linalg.vector_norm(xf).item(), rel=1e-5)
    assert torch.allclose(hadamard_unrotate(y, 3).view(shape), x.float(), atol=1e-5)


def test_input_is_not_modified():
    x = torch.randn(2048)
    before = x.clone()
    hadamard_unrotate(hadamard_rotate(x, 0), 0)
    assert torch.equal(x, before)


def test_seeds():
    x = torch.randn(4096)
    assert torch.equal(hadamard_signs(100, 7), hadamard_signs(100, 7))
    assert torch.equal(hadamard_rotate(x, 7), hadamard_rotate(x, 7))
    assert not torch.equal(hadamard_signs(100, 7), hadamard_signs(100, 8))
    assert not torch.equal(hadamard_rotate(x, 7), hadamard_rotate(x, 8))
    s = hadamard_signs(1000, 1)
    assert set(s.unique().tolist()) == {-1.0, 1.0}
    # precomputed signs give the same result
    assert torch.equal(hadamard_rotate(x, 7, signs=hadamard_signs(4096, 7)), hadamard_rotate(x, 7))


def test_rotation_gaussianizes_a_spike():
    x = torch.zeros(1024)
    x[5] = 1.0
    y = hadamard_rotate(x, 0)
    assert torch.allclose(y.abs(), torch.full_like(y, 1 / 32))


@pytest.mark.parametrize("block", [0, 1, 3, 12, 2**21, 4.0, True])
def test_bad_block(block):
    with pytest.raises(ValueError, match="block"):
        hadamard_rotate(torch.ones(4), 0, block)


def test_bad_inputs():
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        hadamard_rotate(torch.ones(4, dtype=torch.int32), 0)
    with pytest.raises(TypeError, match="seed"):
        hadamard_rotate(torch.ones(4), 0.5)
    with pytest.raises(ValueError, match="signs"):
        hadamard_rotate(torch.ones(4), 0, signs=torch.ones(3))
