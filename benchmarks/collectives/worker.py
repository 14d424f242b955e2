"""One rank of :mod:`benchmarks.collectives.driver`, started inside the emulated network.

For each size N and each algorithm it runs warm-up synchronizations, then ``reps`` timed
ones, each preceded by a barrier so that all ranks start together. Around the timed
block it reads this rank's link counters (:func:`benchmarks.harness.netem.rank_counters`); the
bytes of the barriers alone, measured the same way with an empty synchronization, are
subtracted. After the block (outside the counted window) rank 0 gathers every rank's
times and bytes and appends one JSON record per (N, algorithm) to ``--out``.

A synchronization's time is the slowest rank's: a step cannot go on before every rank
has its result. What is timed, per algorithm (x: N float32 values on every rank):

* fp32          ``full_allreduce(x)`` (what DDP does by default)
* fp16_hook     ``full_allreduce(x / P, wire_dtype=float16)``: DDP's fp16_compress_hook
* powersgd_rK   PowerSGD rank K on a GPT-like set of shapes totalling N (:mod:`.powersgd`)
* lioncub_1bit  ``majority_vote(x, step)``: sign bits, all-to-all, vote, all-gather
* summed_sign   ``summed_allreduce(sign_bits(x), 1, signed=False)``: 0/1 votes, P-sum lanes
* summed_lpB    ``summed_allreduce(lp_quantize_levels(x, L), L, lane_bits=B)`` with
                ``L = max_levels(P, B)``, for the lanes B in (4, 8) that hold a signed code
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import astuple
from datetime import timedelta

import torch
import torch.distributed as dist

from benchmarks.harness.netem import Counters, rank_counters
from benchmarks.harness.powersgd import PowerSGD, transformer_shapes
from lowbit_strategy.codecs.lp import lp_quantize_levels
from lowbit_strategy.codecs.signs import sign_bits
from lowbit_strategy.collectives import (
    TrafficLog, full_allreduce, majority_vote, max_levels, recording, summed_allreduce,
)
from lowbit_strategy.pricing import estimate

#: name -> cost-model name (None: not in the model; PowerSGD is priced as its fp32 allreduces)
MODEL_NAMES = {"fp32": "fp32", "fp16_hook": "bf16", "lioncub_1bit": "1bit", "summed_sign": "sign",
               "summed_lp4": "lp4", "summed_lp8": "lp8", "powersgd_r1": None, "powersgd_r4": None}


def algorithms(x: torch.Tensor, p: int, names: list[str]) -> dict[str, tuple]:
    """name -> (callable doing one synchronization, PowerSGD state or None)."""
    step = [0]

    def next_step() -> int:
        step[0] += 1
        return step[0]

    out: dict[str, tuple] = {
        "fp32": (lambda: full_allreduce(x), None),
        "fp16_hook": (lambda: full_allreduce(x / p, wire_dtype=torch.float16), None),
        "lioncub_1bit": (lambda: majority_vote(x, next_step()), None),
        "summed_sign": (lambda: summed_allreduce(sign_bits(x, next_step()), 1, signed=False).float(), None),
    }
    for lane in (4, 8):
        levels = max_levels(p, lane)
        if levels >= 1:
            out[f"summed_lp{lane}"] = (
                lambda lv=levels, b=lane: summed_allreduce(lp_quantize_levels(x, lv), lv, lane_bits=b).float(), None)
    shapes = transformer_shapes(x.numel())
    grads = [t.view(s) for t, s in zip(x.split([_prod(s) for s in shapes]), shapes)]
    for k in (1, 4):
        state = PowerSGD(shapes, k)
        out[f"powersgd_r{k}"] = (lambda st=state: st.synchronize(grads, p), state)
    return {name: out[name] for name in names if name in out}


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def measure(fn, reps: int) -> tuple[list[float], Counters, TrafficLog]:
    """Per-rep seconds on this rank, counter delta over the block, recorded traffic."""
    traffic, times = TrafficLog(), []
    dist.barrier()
    before = rank_counters()
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        with recording(traffic):
            fn()
        times.append(time.perf_counter() - start)
    dist.barrier()
    return times, rank_counters() - before, traffic


def gather(values: list[float]) -> list[list[float]]:
    """Every rank's ``values`` (same length on all ranks), indexed [rank][i]."""
    mine = torch.tensor(values, dtype=torch.float64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


def model_seconds(name: str, p: int, n: int, alpha: float, bps: float, state) -> tuple[float | None, str]:
    """Cost-model prediction for one synchronization (None on an unshaped link)."""
    if not bps:
        return None, "n/a (unshaped link)"
    if state is not None:
        secs = sum(estimate("fp32", p, m, alpha, bps).seconds for m in state.payload_numels())
        return secs, "fp32 model on each PowerSGD allreduce"
    return estimate(MODEL_NAMES[name], p, n, alpha, bps).seconds, MODEL_NAMES[name]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", required=True, help="comma-separated N")
    parser.add_argument("--algorithms", default=",".join(MODEL_NAMES))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", required=True, help="JSON-lines file rank 0 appends records to")
    parser.add_argument("--timeout", type=float, default=300, help="process-group timeout (s)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # P ranks share this machine's cores
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=args.timeout))
    p, rank = dist.get_world_size(), dist.get_rank()
    link, bps = os.environ.get("LBS_LINK", "?"), float(os.environ.get("LBS_LINK_BPS", "0"))

    tiny = torch.zeros(1)
    for _ in range(5):
        full_allreduce(tiny)
    lat = max(statistics.median(r) for r in gather(measure(lambda: full_allreduce(tiny), 20)[0]))
    alpha = lat / (2 * max(1, (p - 1).bit_length()))  # the model charges 2·ceil(log2 P)·α
    barrier_only = measure(lambda: None, args.reps)[1]

    for n in (int(s) for s in args.sizes.split(",")):
        x = torch.randn(n, generator=torch.Generator().manual_seed(1000 + rank))
        for name, (fn, state) in algorithms(x, p, args.algorithms.split(",")).items():
            for _ in range(args.warmup):
                fn()
            times, delta, traffic = measure(fn, args.reps)
            extra = delta - barrier_only
            row = times + [max(0, v) / args.reps for v in astuple(extra)]
            row += [traffic.bytes_sent / args.reps, traffic.bytes_received / args.reps]
            every = gather(row)
            if rank == 0:
                rec = record(name, p, n, link, bps, alpha, every, args.reps, traffic, state)
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(progress(rec), flush=True)
            del fn, state
    dist.destroy_process_group()
    return 0


def record(name, p, n, link, bps, alpha, every, reps, traffic, state) -> dict:
    """One JSON record from every rank's [times..., if_tx, if_rx, wire_tx, wire_rx, rec_sent, rec_recv]."""
    times = [max(r[i] for r in every) for i in range(reps)]
    keys = ("if_tx", "if_rx", "wire_tx", "wire_rx", "recorded_sent", "recorded_received")
    per_rank = [dict(zip(keys, (int(v) for v in r[reps:]))) for r in every]
    wire = max(max(r["wire_tx"], r["wire_rx"]) for r in per_rank)
    bound = wire * 8 / bps if bps else None
    median = statistics.median(times)
    model, model_name = model_seconds(name, p, n, alpha, bps, state)
    return {
        "algorithm": name, "P": p, "N": n, "link": link, "link_bps": bps or None,
        "times_s": times, "median_s": median, "per_rank": per_rank,
        "wire_bytes_per_rank": wire, "recorded_bytes_per_rank": max(r["recorded_sent"] for r in per_rank),
        "recorded_by_op": {k: v // reps for k, v in traffic.by_op().items()},
        "bound_s": bound, "measured_over_bound": median / bound if bound else None,
        "model_s": model, "model": model_name, "alpha_s": alpha,
    }


def progress(rec: dict) -> str:
    ratio = f"{rec['measured_over_bound']:.2f}x bound" if rec["bound_s"] else "unshaped"
    return (f"P={rec['P']} {rec['link']:>8} N={rec['N']:>10,} {rec['algorithm']:<13} "
            f"{rec['median_s'] * 1e3:9.1f} ms  wire {rec['wire_bytes_per_rank'] / 1e6:8.3f} MB/rank  "
            f"recorded {rec['recorded_bytes_per_rank'] / 1e6:8.3f} MB  {ratio}")


if __name__ == "__main__":
    sys.exit(main())
