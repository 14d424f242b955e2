"""The chunked DCT of DeMo (:mod:`lowbit_strategy.codecs.dct`) and the bit fields of its indices
(:mod:`lowbit_strategy.codecs.bitfield`)."""
from __future__ import annotations

import math

import pytest
import torch

from lowbit_strategy.codecs.bitfield import bitfield_bytes, pack_bitfield, unpack_bitfield
from lowbit_strategy.codecs.dct import ChunkDCT, chunk_size, dct_matrix


@pytest.mark.parametrize("n, target, want", [(768, 64, 64), (50, 64, 50), (97, 64, 1), (96, 64, 48), (1, 64, 1),
                                             (64, 64, 64), (4096, 64, 64), (10, 3, 2), (0, 64, 1)])
def test_chunk_is_the_largest_divisor_not_above_the_target(n, target, want):
    assert chunk_size(n, target) == want


def test_the_basis_is_orthonormal_and_is_the_dct_ii():
    f = dct_matrix(8, torch.float64)
    torch.testing.assert_close(f.T @ f, torch.eye(8, dtype=torch.float64))
    x = torch.randn(8, dtype=torch.float64)
    j = torch.arange(8, dtype=torch.float64)
    k = 3
    want = math.sqrt(2 / 8) * (x * torch.cos(math.pi * (2 * j + 1) * k / 16)).sum()
    torch.testing.assert_close((x @ f)[k], want)


@pytest.mark.parametrize("shape", [(16, 24), (5, 16), (16,), (97,), (4, 3, 2), (), (0, 8)])
def test_decode_inverts_encode_and_keeps_energy(shape):
    x = torch.randn(shape)
    t = ChunkDCT(x.shape, 4, "cpu")
    c = t.encode(x)
    assert c.shape == (t.chunks, t.size)
    torch.testing.assert_close(t.decode(c), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(c.pow(2).sum(), x.pow(2).sum(), atol=1e-4, rtol=1e-5)


def test_chunk_order_is_row_major_and_coefficients_row_major_inside():
    x = torch.zeros(8, 8)
    x[4:8, 0:4] = 1.0  # the third chunk (chunk row 1, chunk column 0): only its DC coefficient
    c = ChunkDCT(x.shape, 4, "cpu").encode(x)
    assert torch.nonzero(c.abs() > 1e-6).tolist() == [[2, 0]]
    torch.testing.assert_close(c[2, 0], torch.tensor(4.0))


@pytest.mark.parametrize("bits", [1, 3, 7, 8, 12, 13, 24])
def test_bitfields_round_trip_at_any_width(bits):
    n = 37
    codes = torch.randint(0, 2**bits, (n,))
    packed = pack_bitfield(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == bitfield_bytes(n, bits) == math.ceil(n * bits / 8)
    assert torch.equal(unpack_bitfield(packed, bits, n), codes)


def test_bitfield_layout_is_a_little_endian_bit_stream():
    packed = pack_bitfield(torch.tensor([0b101, 0b011]), 3)  # bits 1,0,1, 1,1,0 -> 0b011101
    assert packed.tolist() == [0b011101]
    assert pack_bitfield(torch.tensor([5]), 0).numel() == 0
