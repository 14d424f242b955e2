"""α–β cost model of the majority-vote synchronizations (Lion Cub Table 1, Sec. 3).

With P workers, N parameters, latency α (s) and inverse bandwidth β (s/bit), one
synchronization costs:

=======================  ==========================  ==================================
algorithm                latency                     bandwidth
=======================  ==========================  ==================================
param_server_naive       2(P-1)·α                    2·P·N·b·β
param_server             2·log2(P)·α                 3(P-1)/P·N·b·β
direct (Table 1)         2·log2(P)·α                 2(P-1)/P·N·(log2(P)+1)·β
onebit_table1            (P-1+log2(P))·α             (1+(P-1)/P)·N·β
1bit (ours)              (P-1+log2(P))·α             2(P-1)/P·N·β
sign / lp (ours)         2·log2(P)·α                 2(P-1)/P·N·w·β
fp32 / bf16              2·log2(P)·α                 2(P-1)/P·N·b·β
=======================  ==========================  ==================================

b is the word (32 bits). Table 1 charges the 1-bit all-to-all a full N·β; a pairwise
all-to-all moves only (P-1)/P·N bits per rank, which is what :mod:`.majority` sends (and
the benchmarks measure), so ``1bit`` uses that and ``onebit_table1`` keeps the paper's
figure. "direct" is Table 1's idealized bit count; ours is the
lane-packed variant actually implemented by :mod:`.summed`, where ``w`` is the real lane
width (1, 2, 4, 8, 16 or 32 bits) that holds the sum over P ranks: for ``sign`` (0/1 votes)
the lane holding P, for ``lp`` the fixed lane ``bits`` (usually 8) at whatever code levels
fit it. log2(P) is rounded up to whole rounds. Computation (packing) is ignored, as in
the paper; the benchmarks measure it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from lowbit_strategy.collectives.summed import lane_for, max_levels

WORD_BITS = 32
PAPER_ALGORITHMS = ("param_server_naive", "param_server", "direct", "onebit_table1")
#: Candidates :func:`cheapest` chooses from by default, in tie-break order (first wins).
DEFAULT_CANDIDATES = ("lp8", "sign", "1bit", "bf16", "fp32")


@dataclass(frozen=True)
class Estimate:
    """Predicted seconds of one synchronization with one algorithm."""

    algorithm: str
    bits: int
    latency_s: float
    bandwidth_s: float

    @property
    def seconds(self) -> float:
        return self.latency_s + self.bandwidth_s


def _rounds(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 0


def _parse(name: str) -> tuple[str, int | None]:
    if name.startswith("lp") and name[2:].isdigit():
        return "lp", int(name[2:])
    return name, None


def estimate(name: str, world_size: int, numel: int, latency_s: float, bandwidth_bps: float) -> Estimate:
    """Cost of algorithm ``name`` ("1bit", "sign", "lpB" for a B-bit lane, "fp32", "bf16",
    or a Table 1 baseline from :data:`PAPER_ALGORITHMS`). Raises ``ValueError`` for an
    unknown name and ``OverflowError`` for an lp lane too narrow for ``world_size``."""
    p, n = int(world_size), int(numel)
    if p < 1 or n < 0:
        raise ValueError(f"world_size must be >= 1 and numel >= 0, got {world_size}, {numel}")
    if bandwidth_bps <= 0 or latency_s < 0:
        raise ValueError(f"bandwidth_bps must be > 0 and latency_s >= 0, got {bandwidth_bps}, {latency_s}")
    alpha, beta = float(latency_s), 1.0 / float(bandwidth_bps)
    kind, lane_bits = _parse(name)
    ring = 2 * (p - 1) / p
    if kind == "1bit":
        bits, lat, bw = 1, (p - 1 + _rounds(p)) * alpha, ring * n * beta
    elif kind == "onebit_table1":
        bits, lat, bw = 1, (p - 1 + _rounds(p)) * alpha, (1 + (p - 1) / p) * n * beta
    elif kind == "sign":
        bits = lane_for(p, 1, signed=False).bits
        lat, bw = 2 * _rounds(p) * alpha, ring * n * bits * beta
    elif kind == "lp":
        if max_levels(p, lane_bits, signed=True) < 1:
            raise OverflowError(f"an lp code needs levels >= 1; a {lane_bits}-bit lane cannot hold it at P={p}")
        lane_for(p, 1, signed=True, lane_bits=lane_bits)
        bits, lat, bw = lane_bits, 2 * _rounds(p) * alpha, ring * n * lane_bits * beta
    elif kind in ("fp32", "bf16"):
        bits = 32 if kind == "fp32" else 16
        lat, bw = 2 * _rounds(p) * alpha, ring * n * bits * beta
    elif kind == "direct":
        bits = math.ceil(math.log2(p)) + 1 if p > 1 else 1
        lat, bw = 2 * _rounds(p) * alpha, ring * n * (math.log2(p) + 1) * beta
    elif kind == "param_server":
        bits, lat, bw = WORD_BITS, 2 * _rounds(p) * alpha, 3 * (p - 1) / p * n * WORD_BITS * beta
    elif kind == "param_server_naive":
        bits, lat, bw = WORD_BITS, 2 * (p - 1) * alpha, 2 * p * n * WORD_BITS * beta
    else:
        raise ValueError(
            f"unknown algorithm {name!r}; use 1bit, sign, lpB (B a lane width: 2, 4, 8, 16, 32), fp32, bf16, "
            f"or one of {PAPER_ALGORITHMS}"
        )
    if p == 1:
        lat = bw = 0.0
    return Estimate(name, bits, lat, bw)


def cheapest(
    world_size: int,
    numel: int,
    latency_s: float,
    bandwidth_bps: float,
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES,
) -> Estimate:
    """The cheapest of ``candidates`` for this P, N and link.

    Candidates that cannot run at this world size (an lp lane too narrow) are skipped.
    Ties go to the earlier candidate, so list higher-fidelity algorithms first.
    """
    best: Estimate | None = None
    for name in candidates:
        try:
            e = estimate(name, world_size, numel, latency_s, bandwidth_bps)
        except OverflowError:
            continue
        if best is None or e.seconds < best.seconds:
            best = e
    if best is None:
        raise OverflowError(f"no candidate of {candidates} can run at world size {world_size}")
    return best
