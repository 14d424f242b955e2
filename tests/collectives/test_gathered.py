"""BitDP low-bit all-gather + scales (collectives/gathered.py).

Pure decode-and-reduce is checked with hypothesis against the single-process reference
(mean over ranks of the dequantized gradients, or Eq. 10); the collective itself runs on
real gloo groups — P = 2, 3, 4 as subgroups of one spawned run shared with the two-stage
form's tests (test_gathered_two_stage.py), P = 1 in this process —
where every rank rebuilds all ranks' gradients from a seed. Bytes on the wire are
asserted, and chunked decoding is shown to bound peak memory.
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from lowbit_strategy.codecs import channel_decode, channel_encode
from lowbit_strategy.collectives import recording
from lowbit_strategy.collectives.gathered import (
    PayloadLayout,
    decode_reduce,
    encode,
    gathered_mean,
    gathered_mean_async,
)


def _grads(seed: int, world_size: int, shapes) -> list[list[torch.Tensor]]:
    """Every rank's gradients: gaussian, with exact zeros and (if tall enough) a zero row."""
    out = []
    for r in range(world_size):
        gen = torch.Generator().manual_seed(seed * 1000 + r)
        mats = []
        for rows, cols in shapes:
            m = torch.randn(rows, cols, generator=gen) * (r + 1)  # scales differ across ranks
            m[torch.rand(rows, cols, generator=gen) < 0.1] = 0.0
            if rows > 2:
                m[1] = 0.0
            mats.append(m)
        out.append(mats)
    return out


def _reference(per_rank, bits: int, reduction: str) -> torch.Tensor:
    """Single-process reference: exact mean of s_r ⊙ q_r, or Eq. 10 (mean s) ⊙ (mean q)."""
    p, parts = len(per_rank), []
    for k in range(len(per_rank[0])):
        enc = [channel_encode(per_rank[r][k], bits) for r in range(p)]
        if reduction == "mean":
            parts.append(torch.stack([channel_decode(c, s, bits) for c, s in enc]).mean(0))
        else:
            s_ar = torch.stack([s for _, s in enc]).mean(0)
            q_ar = torch.stack([channel_decode(c, torch.ones_like(s), bits) for c, s in enc]).sum(0)
            parts.append(s_ar.unsqueeze(1) * q_ar / p)
    return torch.cat([x.reshape(-1) for x in parts])


def _stacked(per_rank, bits):
    enc = [encode(mats, bits) for mats in per_rank]
    layout = enc[0][0]
    return layout, torch.stack([w for _, w, _ in enc]), torch.stack([s for _, _, s in enc])


shapes_st = st.lists(st.tuples(st.integers(1, 9), st.integers(1, 11)), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    world_size=st.integers(1, 5),
    shapes=shapes_st,
    bits=st.sampled_from([1, 2]),
    chunk_rows=st.sampled_from([None, 1, 2, 3, 7]),
    reduction=st.sampled_from(["mean", "paper"]),
)
def test_decode_reduce_matches_reference(seed, world_size, shapes, bits, chunk_rows, reduction):
    per_rank = _grads(seed, world_size, shapes)
    layout, words, scales = _stacked(per_rank, bits)
    if reduction == "paper":
        scales = scales.mean(0)
    got = decode_reduce(words, scales, layout, reduction=reduction, chunk_rows=chunk_rows)
    torch.testing.assert_close(got, _reference(per_rank, bits, reduction), rtol=1e-5, atol=1e-6)
    # chunking changes memory, never the bits of the result
    whole = decode_reduce(words, scales, layout, reduction=reduction, chunk_rows=None)
    assert torch.equal(got, whole)
    # writing into per-matrix views gives the same values
    views = [torch.empty(r, c) for r, c in layout.shapes]
    decode_reduce(words, scales, layout, reduction=reduction, chunk_rows=chunk_rows, out=views)
    assert torch.equal(torch.cat([v.reshape(-1) for v in views]), got)


@settings(deadline=None)
@given(shapes=shapes_st, bits=st.sampled_from([1, 2]))
def test_layout_offsets(shapes, bits):
    layout = PayloadLayout.of(shapes, bits)
    per_word = 8 // bits
    sizes = [-(-r * c // per_word) for r, c in shapes]
    assert layout.words == sum(sizes)
    assert list(layout.word_offsets) == [sum(sizes[:i]) for i in range(len(shapes))]
    assert layout.rows == sum(r for r, _ in shapes)
    assert layout.numel == sum(r * c for r, c in shapes)
    _, words, scales = encode([torch.randn(r, c) for r, c in shapes], bits)
    assert words.dtype == torch.uint8 and words.numel() == layout.words
    assert scales.dtype == torch.float32 and scales.numel() == layout.rows


def test_paper_reduction_differs_from_exact_mean():
    per_rank = _grads(3, 3, [(6, 20)])
    layout, words, scales = _stacked(per_rank, 2)
    exact = decode_reduce(words, scales, layout)
    paper = decode_reduce(words, scales.mean(0), layout, reduction="paper")
    assert (exact - paper).abs().max() > 1e-3
    # Eq. 10 by hand: g = 1/P · mean_r(s_r) ⊙ sum_r(q_r)
    q = torch.stack([channel_decode(c, torch.ones(6), 2) for c, _ in (channel_encode(m[0], 2) for m in per_rank)])
    torch.testing.assert_close(paper.view(6, 20), scales.mean(0).unsqueeze(1) * q.sum(0) / 3)


def _peak_bytes(fn) -> int:
    """Peak bytes allocated by ``fn`` above what existed before, from the public torch
    profiler events: each op's own allocations at its start, each free ("[memory]"
    events) when it happens, replayed in time order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    deltas = sorted((e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
                    for e in prof.events())
    assert any(d > 0 for _, d in deltas), "the profiler recorded no allocation"
    cur = peak = 0
    for _, delta in deltas:
        cur += delta
        peak = max(peak, cur)
    return peak


@pytest.mark.parametrize("bits", [1, 2])
def test_chunked_decode_bounds_peak_memory(bits):
    p, rows, cols = 4, 512, 256
    layout, words, scales = _stacked(_grads(1, p, [(rows, cols)]), bits)
    out = torch.empty(layout.numel)
    whole = _peak_bytes(lambda: decode_reduce(words, scales, layout, chunk_rows=None, out=out))
    chunked = _peak_bytes(lambda: decode_reduce(words, scales, layout, chunk_rows=16, out=out))
    # about 8 bytes per element of every rank's chunk (the ranks decoded at once, then one
    # reduction over them), independent of the matrix height
    assert chunked <= 8 * p * 16 * cols + 4096, chunked
    assert whole >= 4 * rows * cols, whole
    assert chunked * 8 < whole


def test_bad_input_is_a_clear_error():
    layout, words, scales = _stacked(_grads(0, 2, [(3, 4)]), 2)
    with pytest.raises(ValueError, match="bits=1 or bits=2"):
        PayloadLayout.of([(3, 4)], 4)
    with pytest.raises(ValueError, match="reduction: got 'sum'"):
        decode_reduce(words, scales, layout, reduction="sum")
    with pytest.raises(ValueError, match="chunk_rows: got 0"):
        decode_reduce(words, scales, layout, chunk_rows=0)
    with pytest.raises(ValueError, match=r"scales of shape \(3,\)"):
        decode_reduce(words, scales, layout, reduction="paper")
    with pytest.raises(ValueError, match="words must be"):
        decode_reduce(words[:, 1:], scales, layout)
    with pytest.raises(ValueError, match="out must hold"):
        decode_reduce(words, scales, layout, out=torch.empty(5))
    with pytest.raises(ValueError, match="at least one non-empty"):
        PayloadLayout.of([], 1)
    with pytest.raises(RuntimeError, match="not initialized"):
        gathered_mean(words[0], scales[0], layout)


CASES = [  # (bits, reduction, chunk_rows, shapes)
    (1, "mean", None, [(4, 9)]),
    (2, "mean", 2, [(5, 7), (1, 3), (3, 1), (8, 16)]),
    (1, "paper", 3, [(6, 5), (2, 2)]),
    (2, "paper", None, [(7, 13)]),
]


def _check_gathered(rank, world_size, group=None):
    for i, (bits, reduction, chunk_rows, shapes) in enumerate(CASES):
        per_rank = _grads(10 + i, world_size, shapes)
        layout, words, scales = encode(per_rank[rank], bits)
        with recording() as traffic:
            got = gathered_mean(words, scales, layout, group, reduction=reduction, chunk_rows=chunk_rows)
        torch.testing.assert_close(got, _reference(per_rank, bits, reduction), rtol=1e-5, atol=1e-6)
        # bytes: (P-1) x packed words gathered, plus the scales gathered ("mean") or allreduced
        p = world_size
        codes = (p - 1) * sum(-(-r * c * bits // 8) for r, c in shapes)
        rows4 = 4 * sum(r for r, _ in shapes)
        if reduction == "mean":
            expected = [("gathered.codes.all_gather", codes), ("gathered.scales.all_gather", (p - 1) * rows4)]
        else:
            ring = 2 * (p - 1) * (-(-rows4 // p)) if p > 1 else 0
            expected = [("gathered.codes.all_gather", codes), ("gathered.scales.allreduce", ring)]
        # both transfers run concurrently: their records arrive in completion order
        assert sorted((r.op, r.bytes_sent) for r in traffic.records) == sorted(expected)
        assert codes == (p - 1) * words.numel()

        with recording() as alog:
            fut = gathered_mean_async(words, scales, layout, group, reduction=reduction, chunk_rows=chunk_rows)
            again = fut.wait()
        assert torch.equal(again, got), "async and blocking must agree bit for bit"
        assert sorted((r.op, r.bytes_sent) for r in alog.records) == sorted(expected)

        # every rank holds bit-identical results (replicas cannot drift)
        every = torch.empty(p * got.numel())
        dist.all_gather_single(every, got, group=group)
        assert all(torch.equal(x, got) for x in every.view(p, -1))


@contextlib.contextmanager
def one_rank_group():
    """A world-size-1 gloo group in this very process (no spawn: the network-free path)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_gathered_one_rank():
    with one_rank_group():
        _check_gathered(0, 1)


# The gloo run (P = 2, 3, 4) shares its launch with the two-stage form's:
# tests/collectives/test_gathered_two_stage.py::test_both_forms_on_gloo.


@pytest.mark.parametrize("bits", [1, 2])
def test_pack_payload_packs_a_stacks_adjacent_codes_at_once(monkeypatch, bits):
    # a stack's codes are views back to back in one tensor: packed in one call where each but
    # the last of a run fills whole words, with the words of packing each alone
    from lowbit_strategy.codecs import bits as lanes
    from lowbit_strategy.collectives import gathered

    per = lanes.lane(bits).per_word
    shapes = [(2, 4 * per), (3, 2 * per), (1, per + 1), (2, 2 * per), (1, 3)]  # the third ends mid-word
    n = sum(r * c for r, c in shapes)
    stack = torch.randint(0, 2**bits if bits == 1 else 3, (n,), dtype=torch.uint8)
    codes, at = [], 0
    for r, c in shapes:
        codes.append(stack[at : at + r * c])
        at += r * c
    codes.append(torch.randint(0, 2, (8,), dtype=torch.uint8))  # another storage
    layout = PayloadLayout.of(shapes + [(1, 8)], bits)
    scales = [torch.rand(r) for r, _ in shapes + [(1, 8)]]
    want = torch.cat([lanes.pack(c, bits) for c in codes])
    calls = []
    real = lanes.pack
    monkeypatch.setattr(lanes, "pack", lambda c, *a, **k: (calls.append(c.numel()), real(c, *a, **k))[1])
    words, _ = gathered.pack_payload(codes, scales, layout)
    assert torch.equal(words, want) and words.numel() == layout.words
    # runs: the first three (the third's end is the run's end), the last two of the stack, the other storage
    assert calls == [sum(r * c for r, c in shapes[:3]), sum(r * c for r, c in shapes[3:]), 8]
    # never joined: a gap, an overlap, a strided view, another dtype of the same storage; joined
    # from an offset that is not a whole word
    s = stack[: 8 * per]
    cases = {
        "gap": ([s[:per], s[2 * per : 3 * per]], [per, per]),
        "overlap": ([s[:per], s[per // 2 : per // 2 + per]], [per, per]),
        "strided": ([s[:per], s[per : 3 * per : 2]], [per, per]),
        "unaligned": ([s[1 : 1 + per], s[1 + per : 1 + 3 * per]], [3 * per]),
    }
    words32 = torch.zeros(2 * per, dtype=torch.int32)
    cases["dtype"] = ([words32[:per], words32.view(torch.uint8)[per : 2 * per]], [per, per])  # offsets in its units
    for name, (parts, want_calls) in cases.items():
        calls.clear()
        lay = PayloadLayout.of([(1, p.numel()) for p in parts], bits)
        got, _ = gathered.pack_payload(parts, [torch.rand(1) for _ in parts], lay)
        assert calls == want_calls, name
        assert torch.equal(got, torch.cat([real(p.reshape(-1), bits) for p in parts])), name
