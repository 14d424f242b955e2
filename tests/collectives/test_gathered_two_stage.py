"""BitDP's two-stage form (collectives/gathered_two_stage.py) and its cost-model bytes.

The chunk split is checked on its own (balanced within a row, deterministic, empty chunks);
the collective runs on real gloo groups — P = 2, 3, 4 as subgroups of one spawned run, P = 1
in this process — against a single-process oracle built from every rank's codes, the same
chunk split, the same summation order (rank_sum) and every rank's server error: bit for
bit, over three steps (the server errors carry over), with a non-finite flag, and with
zero-row chunks. The bytes in the TrafficLog equal the cost model's formula.
"""
import pytest
import torch
import torch.distributed as dist

from lowbit_strategy.codecs import channel_decode, channel_encode
from lowbit_strategy.codecs.reduce import rank_sum
from lowbit_strategy.collectives import recording
from lowbit_strategy.pricing.flat import BITDP_TWO_STAGE_MARGIN, bitdp_bytes, bitdp_estimate, bitdp_form
from lowbit_strategy.collectives.gathered import PayloadLayout
from lowbit_strategy.collectives.gathered_two_stage import (
    chunking,
    gathered_two_stage_mean,
    gathered_two_stage_start,
    row_bounds,
    server_error_for,
)
from tests.collectives.test_gathered import _check_gathered, _grads, one_rank_group
from tests.distributed import SUBGROUPS, in_subgroups, run_ranks


def test_rows_are_split_per_matrix_and_chunks_may_be_empty():
    assert row_bounds(8, 4) == (0, 2, 4, 6, 8) and row_bounds(5, 4) == (0, 1, 2, 3, 5)
    assert row_bounds(1, 3) == (0, 0, 0, 1) and row_bounds(7, 1) == (0, 7)
    for rows in (1, 3, 64, 100, 1000):
        for p in (1, 2, 3, 7, 32):
            b = row_bounds(rows, p)
            sizes = [hi - lo for lo, hi in zip(b, b[1:])]
            assert b[0] == 0 and b[-1] == rows and max(sizes) - min(sizes) <= 1


def test_chunk_plan_pieces_and_records():
    plan = chunking(PayloadLayout.of([(3, 4), (1, 3), (5, 2)], 2), 4)
    # rank r owns rows [r·R/P, (r+1)·R/P) of every matrix: (matrix, first row, end row)
    assert plan.pieces == (((2, 0, 1),), ((0, 0, 1), (2, 1, 2)), ((0, 1, 2), (2, 2, 3)),
                           ((0, 2, 3), (1, 0, 1), (2, 3, 5)))
    assert plan.rows == (1, 2, 2, 4) and plan.numel == (2, 6, 6, 11)
    assert plan.words == (1, 2, 2, 3) and (plan.max_words, plan.max_rows) == (3, 4)  # pieces pack apart
    assert plan.wire_bytes(True) == 2 * 3 * (3 + 4 * 5) and plan.wire_bytes(False) == 2 * 3 * (3 + 4 * 4)
    assert plan.chunk_layout(0).shapes == ((1, 2),)
    empty = chunking(PayloadLayout.of([(1, 100)], 1), 3)  # one row: two ranks own nothing
    assert empty.pieces == ((), (), ((0, 0, 1),)) and empty.chunk_layout(0) is None


def _oracle(per_rank, bits, server_errors):
    """Every rank's two-stage result, and every server's new error, in one process: the
    same chunks, the same products q·(s/P), the same rank_sum order, the same re-encoding."""
    p, shapes = len(per_rank), [tuple(m.shape) for m in per_rank[0]]
    layout = PayloadLayout.of(shapes, bits)
    plan = chunking(layout, p)
    enc = [[channel_encode(m, bits) for m in mats] for mats in per_rank]
    out, errors = torch.empty(layout.numel), []
    for r, pieces in enumerate(plan.pieces):
        if not pieces:
            errors.append(server_errors[r].clone())
            continue
        terms = []
        for i in range(p):  # rank i's version of chunk r, dequantized with its scales / P
            parts = []
            for k, a, b in pieces:
                cols = shapes[k][1]
                c, s = enc[i][k]
                parts.append(channel_decode(c[a * cols : b * cols], s[a:b] / p, bits).reshape(-1))
            terms.append(torch.cat(parts))
        y = rank_sum(torch.stack(terms)) + server_errors[r]
        deq, e = [], 0
        for k, a, b in pieces:  # re-encoded piece by piece, decoded into the matrix's rows
            cols = shapes[k][1]
            n = (b - a) * cols
            deq.append(channel_decode(*channel_encode(y[e : e + n].view(b - a, cols), bits), bits).reshape(-1))
            start = layout.elem_offsets[k] + a * cols
            out[start : start + n] = deq[-1]
            e += n
        errors.append(y - torch.cat(deq))
    return out, errors


CASES = [  # (bits, chunk_rows, shapes)
    (2, None, [(5, 7), (1, 3), (3, 1), (8, 16)]),
    (1, 2, [(6, 5), (2, 2), (9, 4)]),
    (2, 3, [(1, 40), (2, 3)]),  # fewer rows than ranks: zero-row chunks at P >= 3
]


def _encode(mats, bits):
    layout = PayloadLayout.of([tuple(m.shape) for m in mats], bits)
    pairs = [channel_encode(m, bits) for m in mats]
    return layout, [c for c, _ in pairs], [s for _, s in pairs]


def _check_two_stage(rank, world_size, group=None):
    p = world_size
    for i, (bits, chunk_rows, shapes) in enumerate(CASES):
        layout = PayloadLayout.of(shapes, bits)
        plan = chunking(layout, p)
        want_errors = [torch.zeros(n) for n in plan.numel]
        err = server_error_for(layout, group)
        assert err.numel() == plan.numel[rank]
        for step in range(3):  # the server error carries over from step to step
            per_rank = _grads(20 + 3 * i + step, p, shapes)
            _, codes, scales = _encode(per_rank[rank], bits)
            want, want_errors = _oracle(per_rank, bits, want_errors)
            with recording() as traffic:
                got = gathered_two_stage_mean(codes, scales, layout, err, group, chunk_rows=chunk_rows)
            assert torch.equal(got, want), f"case {i} step {step}: differs from the oracle"
            assert torch.equal(err, want_errors[rank]), f"case {i} step {step}: server error"
            assert traffic.bytes_sent == bitdp_bytes("two_stage", layout, p, flagged=False)
            assert traffic.by_op() == {
                "gathered.two_stage.codes.all_to_all": (p - 1) * plan.max_words,
                "gathered.two_stage.scales.all_to_all": (p - 1) * 4 * plan.max_rows,
                "gathered.two_stage.codes.all_gather": (p - 1) * plan.max_words,
                "gathered.two_stage.scales.all_gather": (p - 1) * 4 * plan.max_rows,
            }
        # a non-finite flag on the last rank: every rank learns it, no server error moves
        per_rank = _grads(90 + i, p, shapes)
        _, codes, scales = _encode(per_rank[rank], bits)
        kept = err.clone()
        flag = torch.tensor(rank == p - 1)
        with recording() as traffic:
            handle = gathered_two_stage_start(codes, scales, layout, err, group, chunk_rows=chunk_rows, flag=flag)
            got, raised = handle.gather().wait()
        assert bool(raised) and torch.equal(err, kept)
        assert traffic.bytes_sent == bitdp_bytes("two_stage", layout, p, flagged=True)
        # no flag raised: the oracle's result, decoded into the caller's tensors
        out = [torch.empty(r * c) for r, c in shapes]
        got, raised = gathered_two_stage_mean(
            codes, scales, layout, err, group, chunk_rows=chunk_rows, out=out, flag=torch.tensor(False)
        )
        want, want_errors = _oracle(per_rank, bits, want_errors)
        assert got is out and not bool(raised)
        assert torch.equal(torch.cat(out), want) and torch.equal(err, want_errors[rank])
        # every rank holds bit-identical results
        flat = torch.cat(out)
        every = torch.empty(p * flat.numel())
        dist.all_gather_single(every, flat, group=group)
        assert all(torch.equal(x, flat) for x in every.view(p, -1))


def test_two_stage_one_rank():
    with one_rank_group():
        _check_two_stage(0, 1)


def _check_both(rank, world_size, group=None):
    _check_gathered(rank, world_size, group)
    _check_two_stage(rank, world_size, group)


@pytest.mark.slow
def test_both_forms_on_gloo():
    """Both BitDP collectives at P = 2, 3, 4 as gloo subgroups of one 4-process run (one
    spawn for all: see tests.distributed.SUBGROUPS)."""
    run_ranks(len(SUBGROUPS[-1]), in_subgroups, _check_both)


def test_bad_input_is_a_clear_error():
    layout, codes, scales = _encode(_grads(0, 1, [(3, 4)])[0], 2)
    with one_rank_group():
        with pytest.raises(ValueError, match="server_error must be a contiguous float32"):
            gathered_two_stage_mean(codes, scales, layout, torch.zeros(5))
        with pytest.raises(ValueError, match="matrix 0 needs 12 uint8 lane codes and 3 scales"):
            gathered_two_stage_mean([codes[0][:5]], scales, layout, torch.zeros(12))
        with pytest.raises(ValueError, match="chunk_rows: got 0"):
            gathered_two_stage_mean(codes, scales, layout, torch.zeros(12), chunk_rows=0)
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        row_bounds(3, 0)
    with pytest.raises(RuntimeError, match="not initialized"):
        gathered_two_stage_mean(codes, scales, layout, torch.zeros(12))


def test_cost_model_bytes_and_auto_form():
    gpt = PayloadLayout.of([(768, 768)] * 4 + [(3072, 768), (768, 3072)], 2)  # one GPT-2 block's matrices
    words, rows = gpt.words, gpt.rows
    for p in (2, 3, 4, 8, 32):
        assert bitdp_bytes("allgather", gpt, p) == (p - 1) * (words + 4 * (rows + 1))
        assert bitdp_bytes("allgather", gpt, p, reduction="paper", flagged=False) == \
            (p - 1) * words + 2 * (p - 1) * (-(-4 * rows // p))
        two = bitdp_bytes("two_stage", gpt, p)
        ideal = 2 * (p - 1) / p * (words + 4 * rows)
        assert ideal <= two <= ideal * 1.01  # flat in P: within 1 % of 2(P-1)/P of the payload
    assert bitdp_bytes("two_stage", gpt, 1) == bitdp_bytes("allgather", gpt, 1) == 0
    link = (50e-6, 1e9)  # LowBitConfig's defaults: 50 us, 1 Gbit/s
    forms = {p: bitdp_form("auto", gpt, p, *link) for p in (2, 3, 4, 5, 8, 32)}
    assert forms == {2: "allgather", 3: "allgather", 4: "allgather", 5: "two_stage", 8: "two_stage",
                     32: "two_stage"}
    # P <= 4 stays the exact-mean all-gather whatever the link: it sends at most P/2 times more
    for p in (3, 4):
        for lat, bw in ((0.0, 1e6), (0.0, 1e12), (1e-3, 1e9)):
            ag, ts = (bitdp_estimate(f, gpt, p, lat, bw).seconds for f in ("allgather", "two_stage"))
            assert ag < BITDP_TWO_STAGE_MARGIN * ts
    tiny = PayloadLayout.of([(16, 16)], 2)  # latency-bound: the all-gather's fewer rounds win
    assert bitdp_form("auto", tiny, 32, *link) == "allgather"
    assert bitdp_form("auto", gpt, 32, *link, reduction="paper") == "allgather"
    assert bitdp_form("two_stage", gpt, 2, *link) == "two_stage"
    with pytest.raises(ValueError, match="BitDP form: got 'ring'"):
        bitdp_bytes("ring", gpt, 4)
