"""The TurboQuant collectives (all-gather and two-stage means) on real gloo process groups,
P = 1, 2, 3, 4, against the single-process simulation ``turboquant_mean_reference``.

One 4-process world serves every P (subgroups of 1, 2 and 3 ranks with ranks that are not
0..P-1, and the default group). Every rank rebuilds all ranks' inputs from a seed, runs the
simulation on all of them and its collective on its own, and compares bit for bit.
"""
import pytest
import torch
import torch.distributed as dist

from lowbit_strategy.codecs.turboquant import TurboQuantCodec
from lowbit_strategy.collectives import (
    recording,
    turboquant_allgather_mean,
    turboquant_allgather_mean_start,
    turboquant_mean_reference,
    turboquant_scale_groups,
    turboquant_server_chunk_length,
    turboquant_server_error,
    turboquant_two_stage_mean,
    turboquant_two_stage_mean_start,
)
from lowbit_strategy.collectives.turboquant import encode_chunks
from lowbit_strategy.pricing import estimate
from tests.distributed import run_ranks

#: odd, smaller than a block, not divisible by P·block, several blocks per chunk
LENGTHS = [1, 5, 13, 50, 97, 301]
BLOCK = 16
#: (global ranks, or None for the default group): P = 1, 2, 3 (ranks 0, 2, 3) and 4
GROUPS = ([3], [1, 2], [0, 2, 3], None)


def _inputs(seed: int, p: int, n: int) -> list[torch.Tensor]:
    return [torch.randn(n, generator=torch.Generator().manual_seed(seed * 1000 + r)) for r in range(p)]


def _allgather_bytes(n: int, p: int, block: int) -> dict[str, int]:
    return {"turboquant.codes": (p - 1) * -(-n // 2), "turboquant.scales": (p - 1) * 4 * -(-n // block)}


def _two_stage_bytes(n: int, p: int, block: int) -> dict[str, int]:
    c = turboquant_server_chunk_length(n, p, block)
    k, nb = c // 2, -(-c // block)
    return {
        "turboquant.chunk_codes": (p - 1) * k, "turboquant.chunk_scales": (p - 1) * 4 * nb,
        "turboquant.server_codes": (p - 1) * k, "turboquant.server_scales": (p - 1) * 4 * nb,
    }


def _same_on_every_rank(t: torch.Tensor, p: int, group) -> bool:
    every = [torch.empty_like(t) for _ in range(p)]
    dist.all_gather(every, t.contiguous(), group=group)
    return all(torch.equal(e, t) for e in every)


def _check_matches_simulation(rank, p, group):
    for block in (BLOCK, 1024):
        codec = TurboQuantCodec(4, seed=7, block=block)
        for n in LENGTHS + ([1001] if block == 1024 else []):
            inputs = _inputs(n, p, n)
            x = inputs[rank].view(-1, 1) if n % 2 else inputs[rank]  # any shape
            before = x.clone()
            where = f"block={block} n={n}"
            with recording() as traffic:
                got = turboquant_allgather_mean(x, codec, group)
            assert torch.equal(x, before), where
            assert got.shape == x.shape and got.dtype == torch.float32, where
            assert torch.equal(got.view(-1), turboquant_mean_reference(inputs, codec)[rank]), where
            assert traffic.by_op() == _allgather_bytes(n, p, block), where
            assert _same_on_every_rank(got, p, group), where

            server_error = turboquant_server_error(x, codec, group)
            ref_errors = None
            for call in range(2):  # the server error carries over
                inputs = _inputs(n + 100 * call, p, n)
                outputs, ref_errors = turboquant_mean_reference(inputs, codec, True, ref_errors)
                with recording() as traffic:
                    got = turboquant_two_stage_mean(inputs[rank], codec, server_error, group)
                assert torch.equal(got, outputs[rank]), f"{where} call={call}"
                assert torch.equal(server_error, ref_errors[rank]), f"{where} call={call}"
                assert traffic.by_op() == _two_stage_bytes(n, p, block), where
            assert _same_on_every_rank(got, p, group), where
            c = server_error.numel()
            real = max(0, min(c, n - rank * c))
            assert not server_error[real:].any(), f"{where}: padding error must stay 0"


def _check_async_and_nan(rank, p, group):
    codec = TurboQuantCodec(4, seed=1, block=BLOCK)
    n = 97
    a, b = _inputs(1, p, n), _inputs(2, p, n)
    ea, eb = turboquant_server_error(a[rank], codec, group), turboquant_server_error(b[rank], codec, group)
    # two two-stage means and an all-gather mean in flight at once
    start_a = turboquant_two_stage_mean_start(a[rank], codec, ea, group)
    start_b = turboquant_two_stage_mean_start(b[rank], codec, eb, group)
    start_c = turboquant_allgather_mean_start(a[rank].bfloat16(), codec, group, scale=1.0)
    pending_a, pending_b = start_a.gather(), start_b.gather()
    assert start_a.gather() is pending_a
    got_c, got_b, got_a = start_c.wait(), pending_b.wait(), start_a.wait()
    assert torch.equal(got_a, turboquant_mean_reference(a, codec, True)[0][rank])
    assert torch.equal(got_b, turboquant_mean_reference(b, codec, True)[0][rank])
    # a given scale (one shared value: one scale per rank on the wire), bf16 in and out
    ref_c = [codec.decode(codec.encode(x.bfloat16().float(), 1.0)) for x in a]  # bf16 -> float32 is exact
    expected = ref_c[0]
    for d in ref_c[1:]:
        expected = expected + d
    assert got_c.dtype == torch.bfloat16 and torch.equal(got_c, (expected / p).bfloat16())
    assert start_c.scales.shape == (p, 1)
    nb = -(-ea.numel() // BLOCK)
    assert start_a.worker_scales.shape == (p, nb) and start_a.server_scales.shape == (p, nb)
    assert _same_on_every_rank(start_a.server_scales, p, group)
    assert torch.isfinite(start_a.server_scales).all()

    # a NaN on one rank: non-finite scales exposed on every rank, both forms
    x = torch.randn(n)
    if rank == p - 1:
        x[60] = float("nan")
    h1 = turboquant_allgather_mean_start(x, codec, group)
    h1.wait()
    h2 = turboquant_two_stage_mean_start(x, codec, turboquant_server_error(x, codec, group), group)
    assert h2.server_scales is None
    r2 = h2.wait()
    assert not torch.isfinite(h1.scales).all() and not torch.isfinite(h2.server_scales).all()
    assert not torch.isfinite(h1.wait()).all() and not torch.isfinite(r2).all()

    # bf16 in and out through the two-stage form: float32 arithmetic, rounded at the end
    inputs16 = [x.bfloat16() for x in _inputs(5, p, n)]
    outputs, ref_errors = turboquant_mean_reference(inputs16, codec, True)
    server_error = turboquant_server_error(inputs16[rank], codec, group)
    got = turboquant_two_stage_mean(inputs16[rank], codec, server_error, group)
    assert got.dtype == torch.bfloat16 and torch.equal(got, outputs[rank])
    assert torch.equal(server_error, ref_errors[rank])


def _check_error_feedback(rank, p, group):
    """Same inputs call after call: with the server error the running mean of the results
    converges to what the servers received (the mean of the decoded worker chunks), like 1/T;
    without it the re-encoding error stays."""
    codec = TurboQuantCodec(4, seed=3, block=64)
    n, calls = 500, 40
    inputs = _inputs(99, p, n)
    c = turboquant_server_chunk_length(n, p, 64)
    decoded = [torch.cat([codec.decode(q) for q in encode_chunks(x, codec, p, c)])[:n] for x in inputs]
    received = decoded[0]
    for d in decoded[1:]:
        received = received + d
    received = received / p
    target = torch.stack(inputs).mean(0)
    errors = {}
    for feedback in (True, False):
        server_error = turboquant_server_error(inputs[rank], codec, group)
        total = torch.zeros(n, dtype=torch.float64)
        for _ in range(calls):
            if not feedback:
                server_error.zero_()
            total += turboquant_two_stage_mean(inputs[rank], codec, server_error, group).double()
        mean = (total / calls).float()
        if feedback:  # telescoping: sum of results = T·received − the server errors (real parts)
            every = [torch.empty_like(server_error) for _ in range(p)]
            dist.all_gather(every, server_error, group=group)
            residual = torch.cat(every)[:n].double()
            gap = (calls * received.double() - total - residual).norm() / (calls * received.norm())
            assert gap < 1e-5, f"the server errors must hold everything not yet delivered (gap {gap:.2e})"
        errors[feedback] = (float((mean - received).norm() / received.norm()),
                            float((mean - target).norm() / target.norm()))
    (fb_recv, fb_true), (plain_recv, plain_true) = errors[True], errors[False]
    assert fb_recv < plain_recv / 10, errors
    assert fb_true < plain_true, errors


def _check_worker_error_and_scales(rank, p, group):
    """Momentum-level error feedback and given (EMA) scales, both forms, against the
    simulation bit for bit over three calls (the errors carry over)."""
    codec = TurboQuantCodec(4, seed=11, block=BLOCK)
    for n in (5, 97, 301):
        for two_stage in (False, True):
            padded, size = turboquant_scale_groups(n, p, BLOCK, two_stage)
            groups = -(-padded // size)
            worker_errors = [torch.zeros(n) for _ in range(p)]
            server_errors = None
            mine = torch.zeros(n)
            server_error = turboquant_server_error(torch.ones(n), codec, group) if two_stage else None
            for call in range(3):
                inputs = _inputs(7 * n + call, p, n)
                scales = [torch.rand(groups, generator=torch.Generator().manual_seed(r + call)) + 0.5
                          for r in range(p)]
                where = f"n={n} two_stage={two_stage} call={call}"
                if two_stage:
                    outputs, server_errors, worker_errors = turboquant_mean_reference(
                        inputs, codec, True, server_errors, worker_errors, scales)
                    got = turboquant_two_stage_mean(inputs[rank], codec, server_error, group, scale=scales[rank],
                                                    worker_error=mine)
                    assert torch.equal(server_error, server_errors[rank]), where
                else:
                    outputs, worker_errors = turboquant_mean_reference(inputs, codec, False, None, worker_errors,
                                                                       scales)
                    got = turboquant_allgather_mean(inputs[rank], codec, group, scale=scales[rank],
                                                    worker_error=mine)
                assert torch.equal(got, outputs[rank]), where
                assert torch.equal(mine, worker_errors[rank]), where
                assert mine.abs().sum() > 0, where
            with pytest.raises(ValueError, match="worker_error must hold x.numel"):
                turboquant_allgather_mean(torch.ones(n), codec, group, worker_error=torch.zeros(n + 1))
    if p > 1:
        with pytest.raises(ValueError, match="scale must hold 1 or P·ceil"):
            turboquant_two_stage_mean(torch.ones(301), codec, turboquant_server_error(torch.ones(301), codec, group),
                                      group, scale=torch.ones(3))


SUITES = {
    "worker error and scales": _check_worker_error_and_scales,
    "matches simulation": _check_matches_simulation,
    "async and nan": _check_async_and_nan,
    "error feedback": _check_error_feedback,
}


def _check_bad_server_error(rank, p, group):
    codec = TurboQuantCodec(4, block=BLOCK)
    x = torch.randn(40)
    c = turboquant_server_chunk_length(40, p, BLOCK)
    with pytest.raises(TypeError, match="server_error must be float32"):
        turboquant_two_stage_mean(x, codec, torch.zeros(c, dtype=torch.float64), group)
    with pytest.raises(ValueError, match=rf"server_error must hold turboquant_server_chunk_length\(x.numel\(\), P={p}"):
        turboquant_two_stage_mean(x, codec, torch.zeros(c + 1), group)
    with pytest.raises(ValueError, match="server_error must be contiguous"):
        turboquant_two_stage_mean(x, codec, torch.zeros(2 * c)[::2], group)
    if p > 1:  # check=True: a different length or a bad buffer on one rank raises on all
        m = 40 + (rank == 1)
        with pytest.raises(ValueError, match="different lengths"):
            turboquant_allgather_mean(torch.ones(m), codec, group, check=True)
        bad = torch.zeros(c + 1) if rank == 1 else torch.zeros(c)
        with pytest.raises(ValueError, match="server_error must hold" if rank == 1 else r"rank\(s\) \[1\]"):
            turboquant_two_stage_mean(x, codec, bad, group, check=True)
    se = torch.zeros(c)  # check=True on good input: the same result as without
    got = turboquant_two_stage_mean(x, codec, se, group, check=True)
    assert torch.equal(got, turboquant_two_stage_mean(x, codec, torch.zeros(c), group))


def _in_groups(rank, world_size):
    groups = [dist.new_group(ranks) if ranks is not None else None for ranks in GROUPS]  # all ranks, same order
    for ranks, group in zip(GROUPS, groups):
        members = ranks if ranks is not None else list(range(world_size))
        if rank in members:
            p = len(members)
            for name, check in {**SUITES, "bad server_error": _check_bad_server_error}.items():
                try:
                    check(dist.get_rank(group), p, group)
                except AssertionError as e:
                    raise AssertionError(f"P={p} (global ranks {members}), suite {name!r}: {e}") from e
        dist.barrier()


@pytest.mark.slow
def test_turboquant_means_on_gloo():
    """Every suite on P = 1, 2, 3, 4 in one 4-process world (one spawn: most of the time)."""
    run_ranks(4, _in_groups)


def test_server_chunk_length():
    assert turboquant_server_chunk_length(1, 4, 1024) == 8  # n < P: ranks 1..3 own padding only
    assert turboquant_server_chunk_length(1001, 4, 1024) == 256  # n < P·block: partial blocks
    assert turboquant_server_chunk_length(4096, 4, 1024) == 1024  # whole blocks
    assert turboquant_server_chunk_length(4097, 4, 1024) == 2048
    for n in range(1, 300):
        for p in range(1, 6):
            c = turboquant_server_chunk_length(n, p, 16)
            assert c * p >= n and c % 8 == 0 and (n < 16 * p or c % 16 == 0)
    for args, name in (((0, 2, 16), "n"), ((5, 0, 16), "world_size"), ((5, 2, 1.0), "block"), ((True, 2, 16), "n")):
        with pytest.raises(ValueError, match=f"{name} must be a positive int"):
            turboquant_server_chunk_length(*args)


def test_bad_arguments_are_clear_errors():
    codec = TurboQuantCodec(4, block=BLOCK)
    for fn in (turboquant_allgather_mean, turboquant_allgather_mean_start):
        with pytest.raises(TypeError, match="x must be a floating-point tensor"):
            fn(torch.ones(4, dtype=torch.int64), codec)
        with pytest.raises(TypeError, match="x must be a torch.Tensor"):
            fn([1.0, 2.0], codec)
        with pytest.raises(TypeError, match="codec must be a TurboQuantCodec, got str"):
            fn(torch.ones(4), "turboquant")
        with pytest.raises(ValueError, match="x is empty"):
            fn(torch.zeros(0), codec)
    for fn in (turboquant_two_stage_mean, turboquant_two_stage_mean_start):
        with pytest.raises(TypeError, match="codec must be a TurboQuantCodec"):
            fn(torch.ones(4), None, torch.zeros(8))
        with pytest.raises(ValueError, match="x is empty"):
            fn(torch.zeros(0), codec, torch.zeros(8))
    with pytest.raises(RuntimeError, match="not initialized"):
        turboquant_allgather_mean(torch.ones(3), codec)
    with pytest.raises(RuntimeError, match="not initialized"):
        turboquant_server_error(torch.ones(3), codec)


def test_cost_model_picks_the_form_by_world_size():
    n, alpha, bps = 10**8, 1e-5, 1e11
    fp32 = {p: estimate("fp32", p, n, alpha, bps).bandwidth_s for p in (2, 4, 32)}
    ag = {p: estimate("turboquant_allgather", p, n, alpha, bps) for p in (2, 4, 32)}
    ts = {p: estimate("turboquant_two_stage", p, n, alpha, bps) for p in (2, 4, 32)}
    # all-gather: (P-1)·N/2 bytes (+ scales) vs the fp32 ring's 2(P-1)/P·4N
    assert 7.9 < fp32[2] / ag[2].bandwidth_s < 8
    assert 3.9 < fp32[4] / ag[4].bandwidth_s < 4
    assert 2 < ag[32].bandwidth_s / fp32[32] < 2.1  # 2x MORE than fp32 at P = 32
    # two-stage: ~8x below fp32 at any P
    assert all(7.9 < fp32[p] / ts[p].bandwidth_s < 8 for p in (2, 4, 32))
    # P = 2: the same bytes, one round fewer for the all-gather form; P = 32: two-stage wins
    assert ag[2].bandwidth_s <= ts[2].bandwidth_s and ag[2].seconds < ts[2].seconds
    assert ts[32].bandwidth_s < ag[32].bandwidth_s / 15 and ts[32].seconds < ag[32].seconds
    assert ag[4].bits == ts[4].bits == 4
    assert estimate("turboquant_allgather", 1, n, alpha, bps).seconds == 0.0
