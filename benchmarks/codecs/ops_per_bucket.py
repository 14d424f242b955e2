"""Operator calls per bucket against P: how many torch operators one bucket's collective
launches on a rank (encode, every launch, the server step, decode), counted with the torch
profiler on P local gloo processes.

On a GPU every operator is at least one kernel launch (~5 µs of CPU each), so a collective
whose work per bucket loops over the ranks launches tens of thousands of kernels per step at
P = 64. This counts the operators rank 0 runs for one bucket of every compressed collective,
at each P given, and prints them beside their ratio to the smallest P (the goal: within 1.2x).
The 1-bit majority vote counts its GPU method (``majority_bits(method="lanes")``, what it
runs on CUDA); on a CPU it keeps the bit-sliced adder (O(P) word operations, faster there).

    python -m benchmarks.codecs.ops_per_bucket [-P 2 4 8] [--numel 262144]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: collectives measured: name -> how to run one bucket of ``x`` on the default group
NAMES = ("lion 1-bit vote", "lion lp 8-bit", "bitdp 2-bit", "1-bit adam (compensated)", "turboquant all-gather",
         "turboquant two-stage")


def _one_bucket(name: str, x: torch.Tensor):
    from lowbit_strategy.codecs.turboquant import TurboQuantCodec
    from lowbit_strategy.collectives import compensated_error_buffers, turboquant_server_error
    from lowbit_strategy.collectives.compensated import compensated_allreduce_start
    from lowbit_strategy.collectives.gathered import encode, gathered_mean_async
    from lowbit_strategy.collectives.majority import majority_vote_start
    from lowbit_strategy.collectives.summed import summed_allreduce_start
    from lowbit_strategy.collectives.turboquant import turboquant_allgather_mean_start, turboquant_two_stage_mean_start
    from lowbit_strategy.codecs import lp_quantize_levels

    if name == "lion 1-bit vote":
        return lambda: majority_vote_start(x, 1, validate=False).gather().wait()
    if name == "lion lp 8-bit":
        codes = lp_quantize_levels(x, 7, 1.0, validate=False)
        return lambda: summed_allreduce_start(codes, 7, lane_bits=8, validate=False).wait()
    if name == "bitdp 2-bit":
        mats = [x[: x.numel() // 2].view(-1, 256), x[x.numel() // 2 :].view(-1, 512)]
        return lambda: gathered_mean_async(*encode(mats, 2)[1:], encode(mats, 2)[0]).wait()
    if name == "1-bit adam (compensated)":
        worker, server = compensated_error_buffers(x)
        return lambda: compensated_allreduce_start(x, worker, server, block=32768).wait()
    codec = TurboQuantCodec(4, block=1024, backend="torch")
    if name == "turboquant all-gather":
        return lambda: turboquant_allgather_mean_start(x, codec).wait()
    server = turboquant_server_error(x, codec)
    return lambda: turboquant_two_stage_mean_start(x, codec, server).wait()


def _under(event, prefixes: tuple[str, ...]) -> bool:
    while event is not None:
        if event.name.startswith(prefixes):
            return True
        event = event.cpu_parent
    return False


def _count(fn) -> int:
    """Operator calls of one ``fn()`` on this rank: leaf operators (no child operators) run
    on this thread outside a collective's launch (``lowbit.launch:<op>``, labelled by
    :mod:`lowbit_strategy.collectives.group`, counts as one: what gloo does inside it, like
    splitting its buffers per peer on the CPU, is the backend's, done by NCCL's kernels), and
    those of the callbacks chained from collectives (``lowbit.callback:...``, on gloo's
    threads)."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm caches (decode tables, signs)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        with torch.autograd.profiler.record_function("bench.main"):
            fn()
    events = prof.events()
    main = next(e.thread for e in events if e.name == "bench.main")
    launches = sum(1 for e in events if e.name.startswith("lowbit.launch:"))
    ours = sum(1 for e in events if not e.cpu_children and not _under(e, ("lowbit.launch:", "c10d::"))
               and (e.thread == main or _under(e, ("lowbit.callback:",))))
    return launches + ours


def _worker(rank: int, world: int, store: str, numel: int, out: str) -> None:
    import lowbit_strategy.collectives.majority as majority
    from lowbit_strategy.codecs.votes import majority_bits

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    majority.majority_bits = functools.partial(majority_bits, method="lanes")  # the CUDA method
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    counts = {name: _count(_one_bucket(name, x)) for name in NAMES}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(counts, f)
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, numel: int) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "counts.json")
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "store"), numel, out), nprocs=world, join=True,
                           start_method="spawn")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-P", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--numel", type=int, default=1 << 18, help="elements of the bucket")
    args = parser.parse_args()
    results = {}
    for p in args.P:
        print(f"P = {p} ...", flush=True)
        results[p] = measure(p, args.numel)
    first = args.P[0]
    print(f"\n| collective (one bucket of {args.numel} elements) | " + " | ".join(f"P = {p}" for p in args.P)
          + f" | max / P = {first} |")
    print("|---|" + "---:|" * (len(args.P) + 1))
    for name in NAMES:
        row = [results[p][name] for p in args.P]
        print(f"| {name} | " + " | ".join(map(str, row)) + f" | {max(row) / row[0]:.2f}x |")


if __name__ == "__main__":
    main()
