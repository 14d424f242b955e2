"""Collectives on real gloo process groups, P = 1, 2, 3, 4.

Every rank rebuilds all ranks' inputs from a seed, runs the collective on its own input,
and compares the result with a single-process reference computed from all inputs; the
traffic it recorded must equal the formula. With ``check=True``, a bad argument on one rank
makes every rank raise, in seconds.
"""
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lowbit_strategy.codecs import bits as lanes
from lowbit_strategy.collectives.majority import majority_vote_start
from lowbit_strategy.collectives import full_allreduce, majority_vote, recording, summed_allreduce
from lowbit_strategy.collectives import wire
from tests.distributed import run_ranks

WORLD_SIZES = [1, 2, 3, 4]
LENGTHS = [1, 7, 8, 63, 1000, 4099]


def _inputs(seed: int, world_size: int, n: int, zeros: bool = True) -> list[torch.Tensor]:
    out = []
    for r in range(world_size):
        gen = torch.Generator().manual_seed(seed * 1000 + r)
        x = torch.randn(n, generator=gen)
        if zeros:
            x[torch.rand(n, generator=gen) < 0.2] = 0.0  # exact zeros exercise the tie rule
        out.append(x)
    return out


def _majority_reference(inputs, step):
    positive_tie = step % 2 == 1
    votes = torch.stack([torch.where(x == 0, torch.tensor(positive_tie), x > 0) for x in inputs]).int()
    ups = votes.sum(0)
    p = len(inputs)
    win = (2 * ups > p) | ((2 * ups == p) & positive_tie)
    return win.float() * 2 - 1


def _check_majority(rank, world_size):
    for n in LENGTHS:
        for step in (1, 2, 7):
            inputs = _inputs(n + step, world_size, n)
            with recording() as traffic:
                got = majority_vote(inputs[rank].view(-1, 1), step)
            assert got.shape == (n, 1) and got.dtype == torch.float32
            assert torch.equal(got.view(-1), _majority_reference(inputs, step)), (n, step)
            c = -(-n // (8 * world_size))
            expected = (world_size - 1) * c
            assert [(r.op, r.bytes_sent, r.bytes_received) for r in traffic.records] == [
                ("majority.all_to_all", expected, expected),
                ("majority.all_gather", expected, expected),
            ]
    # bf16 in, bf16 out; even world sizes produce real ties
    x = _inputs(5, world_size, 64)[rank].bfloat16()
    assert majority_vote(x, 3).dtype == torch.bfloat16
    # started asynchronously with a flag: the same votes, every rank's flag, one more byte per peer
    inputs = _inputs(9, world_size, 100)
    with recording() as traffic:
        vote = majority_vote_start(inputs[rank], 2, flag=torch.tensor(rank % 2 == 1))
        got = vote.gather().wait()
    assert torch.equal(got, _majority_reference(inputs, 2))
    assert vote.flags.tolist() == [r % 2 for r in range(world_size)]
    c = -(-100 // (8 * world_size))
    assert [(r.op, r.bytes_sent) for r in traffic.records] == [
        ("majority.all_to_all", (world_size - 1) * (c + 1)), ("majority.all_gather", (world_size - 1) * c)]


def _check_summed(rank, world_size):
    cases = [  # (levels, signed, lane_bits)
        (1, False, None), (1, True, None), (15, True, None), (7, True, 8), (127, True, None),
        (1000, True, None), (40000, True, None), (3, False, 4),
    ]
    for levels, signed, lane_bits in cases:
        for n in LENGTHS:
            low = -levels if signed else 0
            inputs = []
            for r in range(world_size):
                gen = torch.Generator().manual_seed(levels * 7 + n * 13 + r)
                inputs.append(torch.randint(low, levels + 1, (n,), generator=gen, dtype=torch.int32))
            if n > 3:  # the range's edges on every rank
                for x in inputs:
                    x[0], x[1] = low, levels
            with recording() as traffic:
                got = summed_allreduce(inputs[rank], levels, signed=signed, lane_bits=lane_bits)
            assert got.dtype == torch.int32
            assert torch.equal(got, torch.stack(inputs).sum(0)), (levels, signed, n)
            need = (2 * levels if signed else levels) * world_size
            bits = lane_bits or next(b for b in lanes.LANE_BITS if lanes.lane(b).capacity >= need)
            per_word = {1: 8, 2: 4, 4: 2, 8: 1, 16: 2, 32: 1}[bits]
            word_bytes = 1 if bits <= 8 else 4
            nbytes = -(-n // per_word) * word_bytes
            expected = 2 * (world_size - 1) * (-(-nbytes // world_size)) if world_size > 1 else 0
            assert [(r.op, r.bytes_sent) for r in traffic.records] == [(f"summed.allreduce.{bits}bit", expected)]
    # int8 codes straight from lp_quantize work too
    codes = torch.full((10,), -5, dtype=torch.int8)
    assert summed_allreduce(codes, 5).tolist() == [-5 * world_size] * 10


def _check_full(rank, world_size):
    for n in LENGTHS:
        inputs = _inputs(n, world_size, n, zeros=False)
        before = inputs[rank].clone()
        with recording() as traffic:
            got = full_allreduce(inputs[rank])
        assert torch.equal(inputs[rank], before), "the input must not be modified"
        torch.testing.assert_close(got, torch.stack(inputs).double().sum(0).float(), rtol=1e-6, atol=1e-6)
        expected = 2 * (world_size - 1) * (-(-4 * n // world_size)) if world_size > 1 else 0
        assert traffic.bytes_sent == expected
        got16 = full_allreduce(inputs[rank], wire_dtype=torch.bfloat16)
        assert got16.dtype == torch.float32
        ref16 = torch.stack([x.bfloat16().float() for x in inputs]).sum(0)
        torch.testing.assert_close(got16, ref16, rtol=2e-2, atol=2e-2)


def _check_errors(rank, world_size):
    # overflow: raised on every rank before anything is sent, never a wrapped sum
    with pytest.raises(OverflowError, match=r"8-bit lane holds at most 255; lower levels to at most"):
        summed_allreduce(torch.zeros(4, dtype=torch.int32), 127 * 4 // world_size + 1, lane_bits=8)
    with pytest.raises(OverflowError, match="more than any supported lane"):
        summed_allreduce(torch.zeros(4, dtype=torch.int32), 2**30)
    with pytest.raises(ValueError, match=r"codes must lie in \[-3, 3\], got values in \[-4, 0\]"):
        summed_allreduce(torch.tensor([-4, 0], dtype=torch.int32), 3)
    with pytest.raises(TypeError, match="integer codes"):
        summed_allreduce(torch.zeros(3), 3)
    with pytest.raises(ValueError, match="empty"):
        majority_vote(torch.zeros(0), 1)
    with pytest.raises(TypeError, match="floating-point"):
        majority_vote(torch.zeros(3, dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="NaN"):
        majority_vote(torch.tensor([float("nan"), 1.0]), 1)
    assert majority_vote(torch.tensor([float("nan"), 1.0]), 1, validate=False).shape == (2,)  # no NaN scan
    # debug mode: lengths that differ across ranks are caught on every rank
    n = 10 + (rank if world_size > 1 else 0)
    if world_size > 1:
        with pytest.raises(ValueError, match="different lengths"):
            majority_vote(torch.ones(n), 1, check=True)
        with pytest.raises(ValueError, match="different lengths"):
            summed_allreduce(torch.zeros(n, dtype=torch.int32), 1, check=True)
        with pytest.raises(ValueError, match="different lengths"):
            full_allreduce(torch.ones(n), check=True)
        # invalid input on one rank only: with check=True every rank raises, none hangs
        codes = torch.zeros(4, dtype=torch.int32)
        if rank == 1:
            codes[0] = 99
        with pytest.raises(ValueError, match="rank" if rank != 1 else "codes must lie"):
            summed_allreduce(codes, 1, check=True)
    else:
        assert majority_vote(torch.ones(n), 1, check=True).eq(1).all()


#: the rank whose argument is bad in :func:`_check_one_bad_rank` (not rank 0, nothing special)
BAD_RANK = 1
#: the timeout of the group :func:`_check_one_bad_rank` runs on: a rank left waiting for a peer
#: that raised alone fails after this many seconds (with a CollectiveError), not the default 60
BAD_INPUT_TIMEOUT_S = 10
_I32, _F32 = torch.int32, torch.float32

#: (exception on the bad rank, its message, call(bad, group)): one bad argument per call
BAD_INPUTS = [
    (ValueError, "majority_vote got an empty tensor",
     lambda bad, group: majority_vote(torch.ones(0 if bad else 10), 1, group, check=True)),
    (TypeError, "majority_vote needs a floating-point tensor",
     lambda bad, group: majority_vote(torch.ones(10, dtype=_I32 if bad else _F32), 1, group, check=True)),
    (ValueError, "majority_vote: input contains NaN",
     lambda bad, group: majority_vote(torch.full((10,), float("nan") if bad else 1.0), 1, group, check=True)),
    (TypeError, "step must be an int",
     lambda bad, group: majority_vote(torch.ones(10), 1.0 if bad else 1, group, check=True)),
    (ValueError, "summed_allreduce got an empty tensor",
     lambda bad, group: summed_allreduce(torch.zeros(0 if bad else 10, dtype=_I32), 1, group, check=True)),
    (TypeError, "summed_allreduce needs integer codes",
     lambda bad, group: summed_allreduce(torch.zeros(10, dtype=_F32 if bad else _I32), 1, group, check=True)),
    (ValueError, "levels must be",
     lambda bad, group: summed_allreduce(torch.zeros(10, dtype=_I32), 0 if bad else 1, group, check=True)),
    (OverflowError, "more than any supported lane",
     lambda bad, group: summed_allreduce(torch.zeros(10, dtype=_I32), 2**30 if bad else 1, group, check=True)),
    (ValueError, "full_allreduce got an empty tensor",
     lambda bad, group: full_allreduce(torch.ones(0 if bad else 10), group, check=True)),
    (TypeError, "full_allreduce needs a floating-point tensor",
     lambda bad, group: full_allreduce(torch.ones(10, dtype=_I32 if bad else _F32), group, check=True)),
    (ValueError, "wire_dtype must be one of",
     lambda bad, group: full_allreduce(torch.ones(10), group, wire_dtype=torch.float64 if bad else _F32, check=True)),
]


def _check_one_bad_rank(rank, world_size):
    """``check=True`` and a bad argument on one rank only: that rank raises its own error and
    every other rank a ValueError naming it, well before the group's timeout; then the
    ranks are still in step (a good call agrees everywhere)."""
    group = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=BAD_INPUT_TIMEOUT_S))
    for exc, match, call in BAD_INPUTS:
        start = time.monotonic()
        if rank == BAD_RANK:
            with pytest.raises(exc, match=match):
                call(True, group)
        else:
            with pytest.raises(ValueError, match=rf"invalid input on rank\(s\) \[{BAD_RANK}\]"):
                call(False, group)
        assert time.monotonic() - start < BAD_INPUT_TIMEOUT_S / 2, match
    assert majority_vote(torch.ones(10), 1, group, check=True).eq(1).all()


@pytest.mark.slow
def test_a_bad_argument_on_one_rank_raises_on_every_rank():
    """Majority vote, summed lanes and the full allreduce with ``check=True`` (3 gloo ranks)."""
    run_ranks(3, _check_one_bad_rank)


SUITES = {"majority": _check_majority, "summed": _check_summed, "full": _check_full, "errors": _check_errors}


def _check_suites(rank, world_size):
    for name, check in SUITES.items():
        try:
            check(rank, world_size)
        except AssertionError as e:
            raise AssertionError(f"suite {name!r}: {e}") from e


@pytest.mark.slow
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_collectives(world_size):
    """Every suite (majority vote, summed lanes, full allreduce, errors) in one process group."""
    run_ranks(world_size, _check_suites)


def test_not_initialized_is_a_clear_error():
    with pytest.raises(RuntimeError, match="not initialized"):
        majority_vote(torch.ones(3), 1)


def test_traffic_formulas_and_recording_contexts():
    assert wire.allreduce_bytes(100, 1) == 0
    assert wire.allreduce_bytes(100, 4) == 2 * 3 * 25
    assert wire.allreduce_bytes(101, 4) == 2 * 3 * 26
    assert wire.all_to_all_bytes(10, 3) == 20
    explicit = wire.TrafficLog()
    rec = wire.TrafficRecord("x", 5, 6, 2)
    with recording() as outer:
        with recording() as inner:
            wire.record(rec, explicit)
        wire.record(rec)
    assert (outer.bytes_sent, inner.bytes_sent, explicit.bytes_sent) == (10, 5, 5)
    assert outer.by_op() == {"x": 10}
