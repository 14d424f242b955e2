"""Bytes each rank sends per synchronization, against P, for every method in this package.

    python -m benchmarks.bytes_vs_p [--numel 124000000] [--worlds 2,4,8,16,32]

Reduce-scatter based methods (Lion Cub's votes and lanes, the 1-bit allreduce of 1-bit
Adam/LAMB, the two-stage forms of BitDP and TurboQuant) keep their ratio to fp32 at any P;
all-gather based ones (BitDP's and TurboQuant's paper forms) send every rank's whole
payload to every peer, so they save less as P grows and lose to fp32 past 32/b ranks
(b = bits per element). The figures are the byte formulas the collectives' tests check
against the recorded traffic (bits per element, scales included: BitDP one float32 scale
per output channel, modeled here as rows of 1024 — its two-stage rows are the cost model's
exact formula for that layout, ``cost_model.bitdp_bytes``; TurboQuant one float32 per 1024;
1-bit Adam one float32 per 32768), for ``numel`` elements and the ring's ``2(P-1)/P`` factor.
"""
from __future__ import annotations

import argparse

from lowbit_strategy.collectives import cost_model
from lowbit_strategy.collectives.gathered import Layout
from lowbit_strategy.collectives.summed import lane_for

#: elements per scale of each method's payload (for the few bytes of scales)
ROW = 1024


def per_rank_bytes(method: str, p: int, n: int) -> float:
    """Bytes one rank sends for ``n`` elements at ``p`` ranks."""
    ring = 2 * (p - 1) / p
    gather = p - 1
    if method == "fp32 ring allreduce (DDP)":
        return ring * 4 * n
    if method == "Lion Cub 1-bit majority vote":
        return ring * n / 8
    if method == "Lion Cub sign votes (lane holding P)":
        return ring * n * lane_for(p, 1, signed=False).bits / 8
    if method == "Lion Cub 8-bit L1 lanes":
        return ring * n
    if method == "1-bit Adam/LAMB compensated allreduce":
        return ring * (n / 8 + 4 * n / 32768)
    if method == "BitDP 2-bit all-gather":
        return gather * (n / 4 + 4 * n / ROW)
    if method == "BitDP 1-bit all-gather":
        return gather * (n / 8 + 4 * n / ROW)
    if method in ("BitDP 2-bit two-stage", "BitDP 1-bit two-stage"):
        return cost_model.bitdp_bytes("two_stage", _rows_layout(n, int(method[6])), p, flagged=False)
    if method == "TurboQuant 4-bit all-gather (paper)":
        return gather * n * cost_model._TQ_BITS / 8
    if method == "TurboQuant 4-bit two-stage":
        return ring * n * cost_model._TQ_BITS / 8
    raise ValueError(method)


def _rows_layout(n: int, bits: int) -> Layout:
    """``n`` elements as BitDP matrices of rows of :data:`ROW` (and one shorter row)."""
    shapes = [(n // ROW, ROW)] if n >= ROW else []
    return Layout.of(shapes + ([(1, n % ROW)] if n % ROW else []), bits)


METHODS = ("fp32 ring allreduce (DDP)", "Lion Cub 1-bit majority vote", "Lion Cub sign votes (lane holding P)",
           "Lion Cub 8-bit L1 lanes", "1-bit Adam/LAMB compensated allreduce", "BitDP 2-bit all-gather",
           "BitDP 1-bit all-gather", "BitDP 2-bit two-stage", "BitDP 1-bit two-stage",
           "TurboQuant 4-bit all-gather (paper)", "TurboQuant 4-bit two-stage")


def table(n: int, worlds: list[int]) -> str:
    head = "| method | " + " | ".join(f"P = {p}" for p in worlds) + " |"
    rows = [head, "|---|" + "---:|" * len(worlds)]
    for method in METHODS:
        cells = []
        for p in worlds:
            b, fp32 = per_rank_bytes(method, p, n), per_rank_bytes(METHODS[0], p, n)
            cells.append(f"{b / 2**20:,.0f} MiB ({fp32 / b:.1f}×)" if method != METHODS[0] else f"{b / 2**20:,.0f} MiB")
        rows.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=124_000_000, help="elements synchronized (default: GPT-2 small)")
    ap.add_argument("--worlds", default="2,4,8,16,32")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"Bytes sent per rank per synchronization of {args.numel:,} elements (× = fewer than fp32):\n")
    print(table(args.numel, worlds))


if __name__ == "__main__":
    main()
