"""One Lion Cub synchronization (and one 1-bit Adam/LAMB momentum sync), timed per mode on P local processes (loopback, gloo, one
thread per rank): where the time of a sync goes when the network is free, i.e. the codecs.

For each mode the median over ``--repeat`` syncs of the update vectors of ``--numel``
parameters (split into GPT-like tensors) is printed, beside a memory-bound yardstick: one
copy of the same float32 bytes into a preallocated buffer, on one thread. A codec pipeline near a
memory-bound pass costs a few clones (read the floats once, write the codes once, decode
fused into the update).

    python -m benchmarks.codecs.sync [-P 2] [--numel 2900000] [--repeat 10]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MODES = [("1bit", {"mode": "1bit"}), ("sign (4-bit lanes)", {"mode": "sign", "bits": 4}),
         ("lp p=1 8-bit", {"mode": "lp", "bits": 8}), ("fp32", {"mode": "fp32"})]


def _tensors(numel: int, rank: int) -> list[torch.Tensor]:
    """GPT-like shapes: 3:1 matrices of 1024 columns, a few small vectors."""
    gen = torch.Generator().manual_seed(rank)
    sizes, left = [], numel
    while left > 0:
        n = min(left, 1024 * 768)
        sizes.append(n)
        left -= n
    return [torch.randn(n, generator=gen) for n in sizes]


def _median_seconds(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, world: int, store: str, numel: int, repeat: int, out: str) -> None:
    from lowbit_strategy import LionCommunicator, LowBitConfig, buckets
    from lowbit_strategy.algorithms.onebit import OneBitCommunicator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    updates = _tensors(numel, rank)
    rows = []
    flat = torch.cat(updates)
    buf = torch.empty_like(flat)  # preallocated: a fresh clone would time page faults, not memory
    rows.append(("copy of the same fp32 bytes (yardstick)", _median_seconds(lambda: buf.copy_(flat), repeat)))
    for name, cfg in MODES:
        comm = LionCommunicator(LowBitConfig(**cfg))
        step = iter(range(1, 10**6))
        rows.append((name, _median_seconds(lambda: comm.directions(updates, next(step)), repeat)))
    # 1-bit Adam / LAMB: the same vectors as momenta through the error-compensated allreduce,
    # fused as the optimizer fuses them (one buffer per bucket_size_mb), errors committed
    for name, block in (("1-bit Adam/LAMB momenta, scale_block 32768", 32768),
                        ("1-bit Adam/LAMB momenta, one scale per buffer", None)):
        onebit = OneBitCommunicator(block=block)
        jobs = [(tuple(idx), [updates[i] for i in idx])
                for idx in buckets.partition([t.numel() for t in updates], onebit.bucket_numel)]

        def sync(onebit=onebit, jobs=jobs):
            onebit.synchronize(jobs)
            onebit.commit()

        rows.append((name, _median_seconds(sync, repeat)))
    every = [None] * world
    dist.all_gather_object(every, rows)
    if rank == 0:
        with open(out, "w") as fh:
            for i, (name, _) in enumerate(rows):
                fh.write(f"{name}\t{max(r[i][1] for r in every)}\n")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-P", type=int, default=2)
    parser.add_argument("--numel", type=int, default=2_900_000)
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.tsv")
        mp.start_processes(_worker, args=(args.P, os.path.join(tmp, "store"), args.numel, args.repeat, out),
                           nprocs=args.P, start_method="spawn")
        rows = [line.split("\t") for line in open(out).read().splitlines()]
    clone = float(rows[0][1])
    print(f"one sync, P={args.P}, {args.numel:,} parameters, loopback, 1 thread per rank "
          f"(slowest rank, median of {args.repeat})")
    print("| what | ms | × copy |")
    print("|---|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {1e3 * float(seconds):.1f} | {float(seconds) / clone:.1f} |")


if __name__ == "__main__":
    main()
