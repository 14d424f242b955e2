"""DeMo's payload (:mod:`lowbit_strategy.codecs.topk`): what is selected, what is sent, its
size, and the mean of several workers'."""
from __future__ import annotations

import math

import pytest
import torch

from lowbit_strategy.codecs.topk import TopKCodec, select

SHAPES = [(64, 128), (128,), (10, 7), (3,), (0, 4)]


def test_ties_go_to_the_lower_index():
    c = torch.tensor([[1.0, -3.0, 3.0, 2.0, -3.0]])
    assert sorted(select(c, 2)[0].tolist()) == [1, 2]
    assert sorted(select(c, 3)[0].tolist()) == [1, 2, 4]
    x = torch.randn(50, 64)
    x[:, 10] = x[:, 20] = x[:, 30] = 5.0  # a three-way tie at the top: the two lowest indices
    assert all(sorted(r) == [10, 20] for r in select(x, 2).tolist())
    # otherwise the same set as a stable sort of the magnitudes
    want = torch.sort(x.abs(), dim=1, descending=True, stable=True).indices[:, :7].sort(1).values
    assert torch.equal(select(x, 7).sort(1).values, want)


@pytest.mark.parametrize("values", ["fp32", "bf16", "sign"])
def test_what_is_sent_is_what_receivers_decode(values):
    codec = TopKCodec(SHAPES, 64, 8, values, "cpu")
    xs = [torch.randn(s) for s in SHAPES]
    payload, sent, energy = codec.encode(xs)
    assert payload.numel() == codec.nbytes
    for a, b in zip(sent, codec.decode_one(payload, xs)):
        assert torch.equal(a, b)
    assert 0 < float(energy) < 1
    assert torch.equal(codec.mean(payload.unsqueeze(0), xs)[0], sent[0])  # one worker: its own


def test_sign_values_are_the_chunks_mean_magnitude_rounded_to_bf16():
    codec = TopKCodec([(8,)], 8, 3, "sign", "cpu")
    x = torch.randn(8)
    _, sent, _ = codec.encode([x])
    t = codec.transforms[0]
    coeffs = t.encode(x)
    kept = coeffs[0, select(coeffs, 3)[0]]
    scale = kept.abs().mean().to(torch.bfloat16).float()
    dense = torch.zeros(1, 8)
    dense[0, select(coeffs, 3)[0]] = torch.where(kept >= 0, scale, -scale)
    assert torch.equal(sent[0], t.decode(dense))


def test_payload_size_packs_indices_to_log2_of_the_chunk():
    # a 64 x 64 chunk: 12-bit indices; top-8 signs: 8·13 bits + a bf16 scale = 15 bytes per chunk
    codec = TopKCodec([(256, 256)], 64, 8, "sign", "cpu")
    assert codec.segments[0].index_bits == 12
    chunks = 16
    want = 4 + math.ceil(chunks * 8 * 12 / 8) + math.ceil(chunks * 8 / 8) + 2 * chunks  # flag word, fields
    assert codec.nbytes == -(-want // 4) * 4
    # against DDP bf16's ring all-reduce at 2 workers (16 bits per element): over 500x fewer
    assert 256 * 256 * 2 / codec.nbytes > 500


def test_mean_counts_only_the_workers_that_sent_a_coefficient():
    codec = TopKCodec([(4,)], 4, 1, "fp32", "cpu")
    t = codec.transforms[0]
    a = t.decode(torch.tensor([[2.0, 0.0, 0.0, 0.0]]))  # only coefficient 0
    b = t.decode(torch.tensor([[4.0, 0.0, 0.0, 0.0]]))
    c = t.decode(torch.tensor([[0.0, 0.0, 6.0, 0.0]]))  # only coefficient 2
    payloads = torch.stack([codec.encode([x])[0] for x in (a, b, c)])
    got = codec.mean(payloads, [a])[0]
    torch.testing.assert_close(t.encode(got), torch.tensor([[3.0, 0.0, 6.0, 0.0]]), atol=1e-6, rtol=0)


def test_the_flag_travels_in_the_payload():
    codec = TopKCodec([(4,)], 4, 1, "sign", "cpu")
    good, bad = codec.encode([torch.ones(4)])[0], codec.encode([torch.ones(4)], bad=True)[0]
    assert codec.flags(torch.stack([good, bad])).tolist() == [False, True]
