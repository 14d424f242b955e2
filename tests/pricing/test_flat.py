import math

import pytest

from lowbit_strategy.pricing import cheapest, estimate


def test_table1_formulas():
    P, N, a, bw = 8, 10**6, 1e-5, 1e9
    beta = 1 / bw
    e = estimate("onebit_table1", P, N, a, bw)
    assert e.latency_s == pytest.approx((P - 1 + 3) * a)
    assert e.bandwidth_s == pytest.approx((1 + (P - 1) / P) * N * beta)
    # what majority.py really sends: (P-1)/P·N bits in the all-to-all and again in the all-gather
    e = estimate("1bit", P, N, a, bw)
    assert e.latency_s == pytest.approx((P - 1 + 3) * a)
    assert e.bandwidth_s == pytest.approx(2 * (P - 1) / P * N * beta)
    e = estimate("direct", P, N, a, bw)
    assert e.seconds == pytest.approx(2 * 3 * a + 2 * (P - 1) / P * N * (math.log2(P) + 1) * beta)
    e = estimate("param_server_naive", P, N, a, bw)
    assert e.seconds == pytest.approx(2 * (P - 1) * a + 2 * P * N * 32 * beta)
    e = estimate("param_server", P, N, a, bw)
    assert e.seconds == pytest.approx(2 * 3 * a + 3 * (P - 1) / P * N * 32 * beta)
    e = estimate("fp32", P, N, a, bw)
    assert e.seconds == pytest.approx(2 * 3 * a + 2 * (P - 1) / P * N * 32 * beta)


@pytest.mark.parametrize("P,lane", [(2, 2), (3, 2), (4, 4), (8, 4), (15, 4), (16, 8), (255, 8), (256, 16)])
def test_sign_votes_use_the_lane_that_holds_P(P, lane):
    assert estimate("sign", P, 1000, 0.0, 1e9).bits == lane


def test_lp_lane_too_narrow_is_refused_and_skipped():
    with pytest.raises(OverflowError):
        estimate("lp8", 128, 1000, 0.0, 1e9)  # 2·1·128 > 255: no level fits
    assert estimate("lp8", 127, 1000, 0.0, 1e9).bits == 8
    assert cheapest(128, 1000, 0.0, 1e9, candidates=("lp8", "fp32")).algorithm == "fp32"


def test_cheapest_follows_the_regime():
    # bandwidth-bound (big N, slow link): 1-bit wins
    assert cheapest(4, 10**8, 1e-6, 1e8).algorithm == "1bit"
    # latency-bound at scale: the lane allreduce's log P rounds beat P-1 all-to-all rounds
    assert cheapest(64, 10**3, 1e-3, 1e11).algorithm in ("lp8", "sign")
    # one rank: nothing to send
    assert cheapest(1, 10**6, 1e-3, 1e9).seconds == 0.0


def test_ties_go_to_the_first_candidate():
    # a 32-bit lane costs exactly what fp32 costs (same rounds, same bits), and not nothing
    fp32, lp32 = (estimate(n, 4, 10**6, 1e-5, 1e9) for n in ("fp32", "lp32"))
    assert fp32.seconds == lp32.seconds > 0
    assert cheapest(4, 10**6, 1e-5, 1e9, candidates=("fp32", "lp32")).algorithm == "fp32"
    assert cheapest(4, 10**6, 1e-5, 1e9, candidates=("lp32", "fp32")).algorithm == "lp32"


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown algorithm 'fp8'"):
        estimate("fp8", 2, 10, 0, 1)
    with pytest.raises(ValueError, match="bandwidth_bps must be > 0"):
        estimate("fp32", 2, 10, 0, 0)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        estimate("fp32", 0, 10, 0, 1)


def test_traffic_log_keeps_running_totals_in_bounded_memory():
    from lowbit_strategy.collectives import wire

    log = wire.TrafficLog()
    n = 3 * wire.RECENT
    for i in range(n):
        log.add(wire.TrafficRecord("a" if i % 3 else "b", 10, 7, 2, 0.5))
    assert (log.bytes_sent, log.bytes_received, log.calls, log.seconds) == (10 * n, 7 * n, n, 0.5 * n)
    assert log.by_op() == {"a": 10 * (n - n // 3), "b": 10 * (n // 3)}
    assert len(log.records) == wire.RECENT and log.records[-1].op == ("a" if (n - 1) % 3 else "b")
    log.add(wire.TrafficRecord("a", 1, 1, 2, None))  # a collective the host could not time (CUDA)
    assert log.seconds is None and log.bytes_sent == 10 * n + 1
    log.clear()
    assert (log.bytes_sent, log.calls, log.seconds, len(log.records)) == (0, 0, 0.0, 0)
