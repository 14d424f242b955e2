"""compensated_allreduce on real gloo process groups, P = 1, 2, 3, 4, against the
single-process simulation ``compensated_allreduce_reference``, with one scale per vector
and chunk (``block=None``) and with block scales.

One 4-process world serves every P: subgroups of 1, 2 and 3 ranks (with ranks that are not
0..P-1) and the default group. Every rank rebuilds all ranks' inputs from a seed, runs the
simulation on all of them and its collective on its own, and compares bit for bit: the
result, its worker error and its server error, call after call (the errors carry over).
"""
import pytest
import torch
import torch.distributed as dist

from lowbit_strategy.collectives import (
    compensated_allreduce,
    compensated_allreduce_reference,
    compensated_allreduce_start,
    compensated_error_buffers,
    recording,
    server_chunk_length,
)
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives import wire
from tests.distributed import run_ranks

#: n < P, n not a multiple of 8P, odd, exactly 8P, and a few chunks' worth
LENGTHS = [1, 3, 7, 8, 9, 31, 33, 100, 1001]
#: (global ranks, or None for the default group): P = 1, 2, 3 (ranks 0, 2, 3) and 4
GROUPS = ([3], [1, 2], [0, 2, 3], None)


def _inputs(seed: int, p: int, n: int, dtype=torch.float32) -> list[torch.Tensor]:
    out = []
    for r in range(p):
        gen = torch.Generator().manual_seed(seed * 1000 + r)
        x = torch.randn(n, generator=gen)
        x[torch.rand(n, generator=gen) < 0.1] = 0.0  # exact zeros: sign(0) = +1
        out.append(x.to(dtype))
    return out


def _zeros(p: int, n: int):
    chunk = server_chunk_length(n, p)
    return [torch.zeros(n) for _ in range(p)], [torch.zeros(chunk) for _ in range(p)]


#: block sizes: one byte, two, a non-power of two, a few bytes, more than most n here
BLOCKS = (8, 16, 24, 64, 1024)


def _expected_traffic(n: int, p: int, block: int | None = None) -> dict[str, int]:
    """The documented bytes: (P-1)·c per sign phase, 4 bytes per block per peer per scale phase."""
    c = -(-n // (8 * p))
    nb = 1 if block is None else -(-8 * c // block)
    return {
        "compensated.signs": (p - 1) * c,
        "compensated.scales": (p - 1) * 4 * nb,
        "compensated.server_signs": (p - 1) * c,
        "compensated.server_scales": (p - 1) * 4 * nb,
    }


def _same_on_every_rank(t: torch.Tensor, p: int, group) -> bool:
    every = [torch.empty_like(t) for _ in range(p)]
    dist.all_gather(every, t.contiguous(), group=group)
    return all(torch.equal(e, t) for e in every)


def _check_matches_simulation(rank, p, group):
    for n in LENGTHS:
        ref_worker, ref_server = _zeros(p, n)
        x0 = torch.zeros(n)
        worker_error, server_error = compensated_error_buffers(x0, group)
        assert worker_error.shape == (n,) and server_error.shape == (server_chunk_length(n, p),)
        for call in range(3):  # the errors carry over from call to call
            inputs = _inputs(n * 10 + call, p, n)
            outputs, ref_worker, ref_server = compensated_allreduce_reference(inputs, ref_worker, ref_server)
            x = inputs[rank].view(-1, 1) if n % 2 else inputs[rank]  # any shape
            before = x.clone()
            with recording() as traffic:
                got = compensated_allreduce(x, worker_error, server_error, group)
            where = f"n={n} call={call}"
            assert torch.equal(x, before), f"{where}: the input must not be modified"
            assert got.shape == x.shape and got.dtype == torch.float32, where
            assert torch.equal(got.view(-1), outputs[rank]), where
            assert torch.equal(worker_error, ref_worker[rank]), where
            assert torch.equal(server_error, ref_server[rank]), where
            assert traffic.by_op() == _expected_traffic(n, p), where
            assert all(r.bytes_received == r.bytes_sent and r.world_size == p for r in traffic.records)
        assert _same_on_every_rank(got, p, group), f"n={n}: ranks disagree"
        # padding: server error entries past the real elements stay exactly 0
        chunk = server_chunk_length(n, p)
        real = max(0, min(chunk, n - rank * chunk))
        assert not server_error[real:].any(), f"n={n}: padding error must stay 0"


def _check_blocks_match_simulation(rank, p, group):
    for block in BLOCKS:
        for n in LENGTHS:  # all of them < 1024: one partial block per chunk
            ref_worker, ref_server = _zeros(p, n)
            worker_error, server_error = compensated_error_buffers(torch.zeros(n), group)
            for call in range(2):  # the errors carry over
                inputs = _inputs(n * 10 + call + 7, p, n)
                outputs, ref_worker, ref_server = compensated_allreduce_reference(
                    inputs, ref_worker, ref_server, block=block)
                with recording() as traffic:
                    handle = compensated_allreduce_start(inputs[rank], worker_error, server_error, group, block=block)
                    got = handle.wait()
                where = f"block={block} n={n} call={call}"
                assert torch.equal(got, outputs[rank]), where
                assert torch.equal(worker_error, ref_worker[rank]), where
                assert torch.equal(server_error, ref_server[rank]), where
                assert traffic.by_op() == _expected_traffic(n, p, block), where
            nb = -(-server_chunk_length(n, p) // block)
            assert handle.worker_scales.shape == (p, nb) and handle.server_scales.shape == (p, nb), where
            assert _same_on_every_rank(handle.server_scales, p, group), where
            assert _same_on_every_rank(got, p, group), where
            chunk = server_chunk_length(n, p)
            real = max(0, min(chunk, n - rank * chunk))
            assert not server_error[real:].any(), f"{where}: padding error must stay 0"
            # scales of blocks with no real element are 0 (the last chunks of a short vector)
            blocks_real = -(-real // block)
            assert not handle.worker_scales[:, blocks_real:].any(), where

    # one scale set by the large half of every vector vs. a scale per half: a smaller error
    n, block = 1024 * p, 512
    big = torch.arange(n) % 1024 < 512
    inputs = [x * torch.where(big, 1000.0, 1.0) for x in _inputs(5, p, n)]
    target = torch.stack(inputs).mean(0)
    results = {}
    for b in (None, block):
        we, se = compensated_error_buffers(inputs[rank], group)
        results[b] = compensated_allreduce(inputs[rank], we, se, group, block=b)
    err_one, err_blocks = ((results[b] - target)[~big].norm() for b in (None, block))
    assert err_blocks < target[~big].norm() < err_one / 100, (err_blocks, err_one)

    # a NaN on one rank: the block scales still tell every rank
    x = torch.randn(777)
    if rank == p - 1:
        x[700] = float("nan")
    handle = compensated_allreduce_start(x, *compensated_error_buffers(x, group), group, block=24)
    handle.wait()
    assert not torch.isfinite(handle.server_scales).all()
    assert torch.isfinite(handle.server_scales).sum() == handle.server_scales.numel() - 1  # one block only


def _check_traffic_ratio(rank, p, group):
    n = 64_000
    worker_error, server_error = compensated_error_buffers(torch.zeros(n), group)
    with recording() as traffic:
        compensated_allreduce(torch.randn(n), worker_error, server_error, group)
    assert traffic.by_op() == _expected_traffic(n, p)
    if p > 1:  # ~1/32 of a float32 ring allreduce: n/8 bytes per phase instead of 4n
        ratio = traffic.bytes_sent / wire.allreduce_bytes(4 * n, p)
        assert abs(32 * ratio - 1) < 0.01, ratio


def _check_async_out_and_bf16(rank, p, group):
    n = 777
    # two allreduces in flight at once, gathered in start order, waited in another
    a, b = _inputs(1, p, n), _inputs(2, p, n)
    ea, eb = compensated_error_buffers(a[rank], group), compensated_error_buffers(b[rank], group)
    start_a = compensated_allreduce_start(a[rank], *ea, group)
    start_b = compensated_allreduce_start(b[rank], *eb, group)
    pending_a, pending_b = start_a.gather(), start_b.gather()
    assert start_a.gather() is pending_a  # once
    got_b, got_a = pending_b.wait(), start_a.wait()
    for inputs, got, (we, se) in ((a, got_a, ea), (b, got_b, eb)):
        outputs, ref_worker, ref_server = compensated_allreduce_reference(inputs, *_zeros(p, n))
        assert torch.equal(got, outputs[rank])
        assert torch.equal(we, ref_worker[rank]) and torch.equal(se, ref_server[rank])

    # the scales of both phases, the same on every rank; a NaN anywhere shows in every server scale
    assert start_a.worker_scales.shape == (p,) and start_a.server_scales.shape == (p,)
    assert _same_on_every_rank(start_a.worker_scales, p, group)
    assert _same_on_every_rank(start_a.server_scales, p, group)
    assert torch.isfinite(start_a.server_scales).all()
    x = torch.randn(n)
    if rank == p - 1:
        x[5] = float("nan")
    handle = compensated_allreduce_start(x, *compensated_error_buffers(x, group), group)
    assert handle.server_scales is None
    handle.wait()
    assert not torch.isfinite(handle.worker_scales).all() and not torch.isfinite(handle.server_scales).all()

    # one-scale and block allreduces in flight together, gathered in start order
    start_a = compensated_allreduce_start(a[rank], *compensated_error_buffers(a[rank], group), group, block=16)
    start_b = compensated_allreduce_start(b[rank], *compensated_error_buffers(b[rank], group), group)
    start_a.gather(), start_b.gather()
    assert torch.equal(start_b.wait(), compensated_allreduce_reference(b, *_zeros(p, n))[0][rank])
    assert torch.equal(start_a.wait(), compensated_allreduce_reference(a, *_zeros(p, n), block=16)[0][rank])

    # out= the input itself (a momentum buffer updated in place)
    inputs = _inputs(3, p, n)
    x = inputs[rank].clone()
    we, se = compensated_error_buffers(x, group)
    got = compensated_allreduce(x, we, se, group, out=x)
    outputs, _, _ = compensated_allreduce_reference(inputs, *_zeros(p, n))
    assert got.data_ptr() == x.data_ptr() and torch.equal(x, outputs[rank])

    # bf16 in: float32 arithmetic and errors; bf16 out by default, exact float32 with out=
    inputs16 = _inputs(4, p, n, torch.bfloat16)
    exact = [x.float() for x in inputs16]  # bf16 -> float32 is exact: the same arithmetic
    ref32, ref_worker, ref_server = compensated_allreduce_reference(exact, *_zeros(p, n))
    we, se = compensated_error_buffers(inputs16[rank], group)
    out32 = torch.empty(n)
    got = compensated_allreduce(inputs16[rank], we, se, group, out=out32)
    assert got.dtype == torch.float32 and torch.equal(got, ref32[rank])
    assert torch.equal(we, ref_worker[rank]) and torch.equal(se, ref_server[rank])
    we, se = compensated_error_buffers(inputs16[rank], group)
    got16 = compensated_allreduce(inputs16[rank], we, se, group)
    ref16, _, _ = compensated_allreduce_reference(inputs16, *_zeros(p, n))
    assert got16.dtype == torch.bfloat16 and torch.equal(got16, ref16[rank])
    assert torch.equal(got16, ref32[rank].bfloat16())


def _running_mean_error(rank, p, group, n, iterations, feedback, block=None):
    """Relative distance of the running mean of the results from the exact input mean after
    each of ``iterations`` calls on the same inputs, and the final error buffers."""
    inputs = _inputs(99, p, n, torch.float32)
    target = torch.stack(inputs).double().mean(0)
    worker_error, server_error = compensated_error_buffers(inputs[rank], group)
    total = torch.zeros(n, dtype=torch.float64)
    errors = []
    for t in range(1, iterations + 1):
        if not feedback:
            worker_error.zero_()
            server_error.zero_()
        total += compensated_allreduce(inputs[rank], worker_error, server_error, group, block=block).double()
        errors.append(float((total / t - target).norm() / target.norm()))
    return errors, target, total, worker_error, server_error


def _check_error_feedback(rank, p, group, block=None):
    n, iterations = 1000, 200
    errors, target, total, worker_error, server_error = _running_mean_error(
        rank, p, group, n, iterations, True, block)
    # telescoping: sum of results = T·mean(x) − mean_i(worker_error_i) − server errors (real parts)
    every_worker = torch.empty(p * n)
    g.all_gather(every_worker, worker_error, group, "test.worker_errors")
    every_server = torch.empty(p * server_chunk_length(n, p))
    g.all_gather(every_server, server_error, group, "test.server_errors")
    residual = every_worker.view(p, n).double().mean(0) + every_server[:n].double()
    gap = (iterations * target - total - residual).norm() / (iterations * target.norm())
    assert gap < 1e-5, f"the errors must account for everything not yet delivered (gap {gap:.2e})"
    # the running mean converges like 1/T; without error feedback it stays ~half the mean away
    assert errors[-1] < 0.03, errors[-1]
    assert errors[-1] < errors[19] / 5, (errors[19], errors[-1])
    plain, *_ = _running_mean_error(rank, p, group, n, 20, False, block)
    assert plain[-1] > 0.3 and plain[-1] > 10 * errors[-1], (plain[-1], errors[-1])


def _check_bad_input(rank, p, group):
    x = torch.randn(10)
    we, se = compensated_error_buffers(x, group)
    cases = [
        (TypeError, "x must be a floating-point tensor", (torch.ones(10, dtype=torch.int64), we, se)),
        (TypeError, "worker_error must be float32", (x, we.double(), se)),
        (ValueError, r"worker_error must hold x.numel\(\) = 10 elements, got 11", (x, torch.zeros(11), se)),
        (TypeError, "server_error must be float32", (x, we, se.bfloat16())),
        (ValueError, rf"server_error must hold server_chunk_length\(x.numel\(\), P={p}\) = {se.numel()} elements",
         (x, we, torch.zeros(se.numel() + 8))),
        (ValueError, "worker_error must be contiguous", (x, torch.zeros(20)[::2], se)),
        (ValueError, "x is empty", (torch.zeros(0), torch.zeros(0), se)),
    ]
    for exc, match, args in cases:
        with pytest.raises(exc, match=match):
            compensated_allreduce(*args, group=group)
    with pytest.raises(ValueError, match="out must hold x.numel"):
        compensated_allreduce(x, we, se, group, out=torch.empty(9))
    assert not we.any() and not se.any(), "rejected calls must not touch the error buffers"
    with pytest.raises(ValueError, match="n must be a positive int"):
        server_chunk_length(0, 2)
    for block in (0, 12, -8, 8.0, True):
        with pytest.raises(ValueError, match="block must be None or a positive multiple of 8"):
            compensated_allreduce(x, we, se, group, block=block)
    assert not we.any() and not se.any(), "rejected calls must not touch the error buffers"
    if p > 1:
        # check=True: a different length on one rank, or a bad buffer on one rank, raises on all
        n = 10 + (rank == 1)
        with pytest.raises(ValueError, match="different lengths"):
            compensated_allreduce(torch.ones(n), torch.zeros(n), torch.zeros(server_chunk_length(n, p)), group,
                                  check=True)
        bad = torch.zeros(se.numel() + 8) if rank == 1 else se
        with pytest.raises(ValueError, match="server_error must hold" if rank == 1 else r"rank\(s\) \[1\]"):
            compensated_allreduce(x, we, bad, group, check=True)
        with pytest.raises(ValueError, match="block must be None" if rank == 1 else r"rank\(s\) \[1\]"):
            compensated_allreduce(x, we, se, group, check=True, block=12 if rank == 1 else 16)


#: name -> (check, the P it runs on). Error feedback runs 220 calls: on P = 1 and P = 3
#: (non-power of two, padding in the last chunk), with blocks on P = 2, to keep the test fast.
SUITES = {
    "matches simulation": (_check_matches_simulation, (1, 2, 3, 4)),
    "blocks match simulation": (_check_blocks_match_simulation, (1, 2, 3, 4)),
    "traffic ratio": (_check_traffic_ratio, (1, 2, 3, 4)),
    "async, out and bf16": (_check_async_out_and_bf16, (1, 2, 3, 4)),
    "bad input": (_check_bad_input, (1, 2, 3, 4)),
    "error feedback": (_check_error_feedback, (1, 3)),
    "error feedback, blocks": (lambda rank, p, group: _check_error_feedback(rank, p, group, block=64), (2,)),
}


def _in_groups(rank, world_size):
    groups = [dist.new_group(ranks) if ranks is not None else None for ranks in GROUPS]  # all ranks, same order
    for ranks, group in zip(GROUPS, groups):
        members = ranks if ranks is not None else list(range(world_size))
        if rank in members:
            p = len(members)
            for name, (check, sizes) in SUITES.items():
                if p not in sizes:
                    continue
                try:
                    check(dist.get_rank(group), p, group)
                except AssertionError as e:
                    raise AssertionError(f"P={p} (global ranks {members}), suite {name!r}: {e}") from e
        dist.barrier()


@pytest.mark.slow
def test_compensated_allreduce_on_gloo():
    """Every suite on P = 1, 2, 3, 4 in one 4-process world (one spawn: most of the time)."""
    run_ranks(4, _in_groups)


def test_not_initialized_is_a_clear_error():
    with pytest.raises(RuntimeError, match="not initialized"):
        compensated_allreduce(torch.ones(3), torch.zeros(3), torch.zeros(8))


def test_server_chunk_length():
    assert server_chunk_length(1, 1) == 8
    assert server_chunk_length(3, 4) == 8  # n < P: ranks 1..3 own padding only
    assert server_chunk_length(64, 4) == 16
    assert server_chunk_length(65, 4) == 24
    assert all(server_chunk_length(n, p) * p >= n for n in range(1, 200) for p in range(1, 9))
