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
turboquant_allgather     log2(P)·α                   (P-1)·N·(4+32/1024)·β
turboquant_two_stage     (P-1+log2(P))·α             2(P-1)/P·N·(4+32/1024)·β
=======================  ==========================  ==================================

b is the word (32 bits). Table 1 charges the 1-bit all-to-all a full N·β; a pairwise
all-to-all moves only (P-1)/P·N bits per rank, which is what :mod:`~lowbit_strategy.collectives.majority` sends (and
the benchmarks measure), so ``1bit`` uses that and ``onebit_table1`` keeps the paper's
figure. "direct" is Table 1's idealized bit count; ours is the
lane-packed variant actually implemented by :mod:`~lowbit_strategy.collectives.summed`, where ``w`` is the real lane
width (1, 2, 4, 8, 16 or 32 bits) that holds the sum over P ranks: for ``sign`` (0/1 votes)
the lane holding P, for ``lp`` the fixed lane ``bits`` (usually 8) at whatever code levels
fit it. log2(P) is rounded up to whole rounds. Computation (packing) is ignored, as in
the paper; the benchmarks measure it.

The TurboQuant rows (:mod:`~lowbit_strategy.collectives.turboquant`) are its 4-bit codes plus one float32 scale per
block of the codec's default 1024 elements: the all-gather form sends every rank's whole
vector to every peer, ``(P-1)·N/2`` bytes, so it beats the float32 ring (``2(P-1)/P·4N``)
8x at P = 2, 4x at P = 4 and loses 2x at P = 32; the two-stage form (all-to-all of chunks,
then all-gather of the re-encoded chunks) is ~8x below float32 at any P, with one
all-to-all's latency more.

BitDP (:func:`bitdp_bytes`, :func:`bitdp_estimate`, :func:`bitdp_form`) is costed from its
payload's layout, not from N alone: its scales are one per row and the two-stage form pads
every chunk to the largest (:mod:`~lowbit_strategy.collectives.gathered_two_stage`). Bytes per rank, ``W`` code bytes,
``R`` scales, ``f`` = 1 with the non-finite flag: all-gather ``(P-1)·(W + 4(R+f))`` (Eq. 10's
"paper" reduction allreduces the scales instead: ``(P-1)·W`` + a ring of ``4(R+f)``),
latency ``log2(P)·α``; two-stage ``2(P-1)·(W_max + 4(R_max+f))`` ≈ ``2(P-1)/P·(W + 4R)``,
latency ``(P-1+log2(P))·α``.

Across nodes (the hierarchical form, what crosses each node's link, a bucket's time on a cluster
of nodes), with exact per-bucket bytes for every algorithm: :mod:`.nodes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lowbit_strategy.collectives import wire
from lowbit_strategy.collectives.gathered import PayloadLayout
from lowbit_strategy.collectives.gathered_two_stage import chunking
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


def rounds(p: int) -> int:
    """Latency rounds of a tree/ring step over ``p`` ranks: ``ceil(log2 p)``, 0 for one rank
    (Lion Cub Table 1's log2(P), rounded up to whole rounds). Every cost model counts with it."""
    return math.ceil(math.log2(p)) if p > 1 else 0


def _parse(name: str) -> tuple[str, int | None]:
    if name.startswith("lp") and name[2:].isdigit():
        return "lp", int(name[2:])
    return name, None


# Each rule: (P, rounds, ring factor 2(P-1)/P, lane bits) -> (bits, latency in α, bandwidth in N·β).
def _onebit(p, r, ring, lane):
    return 1, p - 1 + r, ring


def _onebit_table1(p, r, ring, lane):
    return 1, p - 1 + r, 1 + (p - 1) / p


def _sign(p, r, ring, lane):
    bits = lane_for(p, 1, signed=False).bits
    return bits, 2 * r, ring * bits


def _lp(p, r, ring, lane):
    if max_levels(p, lane, signed=True) < 1:
        raise OverflowError(f"an lp code needs levels >= 1; a {lane}-bit lane cannot hold it at P={p}")
    lane_for(p, 1, signed=True, lane_bits=lane)
    return lane, 2 * r, ring * lane


def _word(bits):
    def rule(p, r, ring, lane):
        return bits, 2 * r, ring * bits

    return rule


def _direct(p, r, ring, lane):
    return (math.ceil(math.log2(p)) + 1 if p > 1 else 1), 2 * r, ring * (math.log2(p) + 1)


def _param_server(p, r, ring, lane):
    return WORD_BITS, 2 * r, 3 * (p - 1) / p * WORD_BITS


def _param_server_naive(p, r, ring, lane):
    return WORD_BITS, 2 * (p - 1), 2 * p * WORD_BITS


_TQ_BITS = 4 + WORD_BITS / 1024  # 4-bit codes + a float32 scale per 1024-element block


def _turboquant_allgather(p, r, ring, lane):
    return 4, r, (p - 1) * _TQ_BITS


def _turboquant_two_stage(p, r, ring, lane):
    return 4, p - 1 + r, ring * _TQ_BITS


#: algorithm name (``lp`` for every ``lpB``) -> its row of the table in the module doc
RULES = {
    "1bit": _onebit,
    "onebit_table1": _onebit_table1,
    "sign": _sign,
    "lp": _lp,
    "fp32": _word(32),
    "bf16": _word(16),
    "direct": _direct,
    "param_server": _param_server,
    "param_server_naive": _param_server_naive,
    "turboquant_allgather": _turboquant_allgather,
    "turboquant_two_stage": _turboquant_two_stage,
}


def estimate(name: str, world_size: int, numel: int, latency_s: float, bandwidth_bps: float) -> Estimate:
    """Cost of algorithm ``name`` ("1bit", "sign", "lpB" for a B-bit lane, "fp32", "bf16",
    "turboquant_allgather", "turboquant_two_stage", or a Table 1 baseline from
    :data:`PAPER_ALGORITHMS`). Raises ``ValueError`` for an unknown name and
    ``OverflowError`` for an lp lane too narrow for ``world_size``."""
    p, n = int(world_size), int(numel)
    if p < 1 or n < 0:
        raise ValueError(f"world_size must be >= 1 and numel >= 0, got {world_size}, {numel}")
    if bandwidth_bps <= 0 or latency_s < 0:
        raise ValueError(f"bandwidth_bps must be > 0 and latency_s >= 0, got {bandwidth_bps}, {latency_s}")
    kind, lane_bits = _parse(name)
    rule = RULES.get(kind)
    if rule is None:
        raise ValueError(
            f"unknown algorithm {name!r}; use 1bit, sign, lpB (B a lane width: 2, 4, 8, 16, 32), fp32, bf16, "
            f"turboquant_allgather, turboquant_two_stage, or one of {PAPER_ALGORITHMS}"
        )
    bits, alphas, bits_per_element = rule(p, rounds(p), 2 * (p - 1) / p, lane_bits)
    if p == 1:
        return Estimate(name, bits, 0.0, 0.0)
    return Estimate(name, bits, alphas * float(latency_s), bits_per_element * n / float(bandwidth_bps))


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


# ---- BitDP: bytes from the payload's layout (module docstring) ----------------------------

#: BitDP's forms, as ``bitdp.form`` names them (``auto`` chooses one by :func:`bitdp_form`)
BITDP_FORMS = ("allgather", "two_stage")
#: ``auto`` takes the two-stage form only when the all-gather is predicted at least this many
#: times slower: the two-stage form re-quantizes the mean (a second error, which the server's
#: error feedback only defers), the all-gather form is the paper's exact mean of the ranks'
#: dequantized gradients. With 2: never at P <= 4 (the all-gather sends at most P/2 times the
#: two-stage bytes), from P = 5 on for buckets large enough that bandwidth dominates.
BITDP_TWO_STAGE_MARGIN = 2.0


def bitdp_bytes(
    form: str, layout: PayloadLayout, world_size: int, *, flagged: bool = True, reduction: str = "mean"
) -> int:
    """Bytes one rank sends (= receives) to synchronize one BitDP payload laid out as
    ``layout`` in ``form`` (``allgather`` or ``two_stage``) at ``world_size`` ranks; the
    figures the collectives record in their :class:`~lowbit_strategy.collectives.wire.TrafficLog`."""
    p = int(world_size)
    if p <= 1:
        return 0
    if form == "allgather":
        scales = 4 * (layout.rows + flagged)
        if reduction == "paper":
            return wire.all_gather_bytes(layout.words, p) + wire.allreduce_bytes(scales, p)
        return wire.all_gather_bytes(layout.words + scales, p)
    if form == "two_stage":
        return chunking(layout, p).wire_bytes(flagged)
    raise ValueError(f"BitDP form: got {form!r}; use one of {BITDP_FORMS}")


def bitdp_estimate(
    form: str, layout: PayloadLayout, world_size: int, latency_s: float, bandwidth_bps: float
) -> Estimate:
    """Predicted seconds of one BitDP payload in ``form`` (non-finite flag included)."""
    p, r = int(world_size), rounds(int(world_size))
    if p <= 1:
        return Estimate(f"bitdp_{form}", layout.bits, 0.0, 0.0)
    alphas = r if form == "allgather" else p - 1 + r
    seconds = 8 * bitdp_bytes(form, layout, p) / float(bandwidth_bps)
    return Estimate(f"bitdp_{form}", layout.bits, alphas * float(latency_s), seconds)


def bitdp_form(
    form: str, layout: PayloadLayout, world_size: int, latency_s: float, bandwidth_bps: float, reduction: str = "mean"
) -> str:
    """``form`` itself, or for ``"auto"``: ``two_stage`` when the all-gather is predicted
    :data:`BITDP_TWO_STAGE_MARGIN` times slower or more, else ``allgather`` (always with
    ``reduction="paper"``: Eq. 10 is an all-gather of codes)."""
    if form != "auto":
        return form
    if reduction != "mean" or world_size < 3:
        return "allgather"
    ag = bitdp_estimate("allgather", layout, world_size, latency_s, bandwidth_bps).seconds
    ts = bitdp_estimate("two_stage", layout, world_size, latency_s, bandwidth_bps).seconds
    return "two_stage" if ag >= BITDP_TWO_STAGE_MARGIN * ts else "allgather"
