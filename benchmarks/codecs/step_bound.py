"""1-bit Adam's and Lion Cub 1-bit's step against the comm-free bound: 2 ranks, one shaped link.

The same bytes on the wire (1 bit per parameter and a few scales), so what separates the two
optimizers' fraction of the bound is their CPU work: the compensated allreduce's compress,
server step and decode, and the optimizer's pass, against Lion Cub's sign vote. Each rank is
its own network namespace (:mod:`benchmarks.harness.netem`), a 3-block MLP of ``--width``
(3.1M parameters at 1024) under DDP on gloo, one thread per rank, a fixed batch:

* ``adamw_local`` / ``lion_local``: the bound of each: plain ``torch.optim.AdamW`` /
  ``lowbit_strategy.Lion`` with a DDP hook that keeps each rank's gradient (the same
  computation, nothing on the wire);
* ``adamw_bf16`` / ``lion_bf16``: what users would otherwise run, DDP with torch's
  ``bf16_compress_hook``;
* ``onebit_adam`` (freeze after 5 steps) and ``lion_1bit`` through :func:`lowbit_strategy.attach`.

Per configuration: the median step (forward, backward, ``step()``) over the steps after
``--warm``; "of bound" = the bound of its optimizer over it (1.00: communication and
compression cost nothing); "× DDP bf16" = DDP bf16's step with the same optimizer over it.
Configurations run one after another in the same namespaces, ``--rounds`` times over
(every configuration once per round, so a machine's drift hits all alike); the table gives
each figure's median over the rounds, every round's in brackets: single runs of one
configuration differ by up to a third on a 2-core machine.

    python -m benchmarks.codecs.step_bound [--link 1gbit] [--steps 60] [--warm 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

CONFIGS = ("adamw_local", "adamw_bf16", "onebit_adam", "lion_local", "lion_bf16", "lion_1bit")
#: configuration -> its optimizer family's (comm-free bound, DDP bf16) configurations
OF = {c: ("adamw_local", "adamw_bf16") if c.startswith(("adamw", "onebit")) else ("lion_local", "lion_bf16")
      for c in CONFIGS}


def _rank(config: str, steps: int, warm: int, width: int) -> None:
    """One rank's run (inside its namespace); rank 0 prints ``STEPBOUND {json}``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import lowbit_strategy as lb

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(width // 2, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                        nn.Linear(width, width), nn.GELU(), nn.Linear(width, width // 2))
    ddp = nn.parallel.DistributedDataParallel(net)
    if config.endswith(("_local", "_bf16")):
        def keep(_, bucket):  # the rank's own gradient: nothing on the wire
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        def bf16(state, bucket):  # torch's own hook, under another name: DDP refuses it by name on
            return default_hooks.bf16_compress_hook(state, bucket)  # gloo (benchmarks.harness.baselines)

        ddp.register_comm_hook(None, keep if config.endswith("_local") else bf16)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4) if config.startswith("adamw") else lb.Lion(ddp.parameters(),
                                                                                                        lr=1e-5)
    elif config == "onebit_adam":
        opt = lb.OneBitAdam(ddp.parameters(), lr=1e-4, freeze_step=5)
        lb.attach(ddp, [opt], lb.LowBitConfig(algorithm="onebit_adam"))
    else:
        opt = lb.Lion(ddp.parameters(), lr=1e-5)
        lb.attach(ddp, [opt], lb.LowBitConfig(algorithm="lion", mode="1bit"))
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(64, width // 2, generator=gen), torch.randn(64, width // 2, generator=gen)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad()
        (ddp(x) - y).square().mean().backward()
        opt.step()
        times.append(time.perf_counter() - start)
    if rank == 0:
        params = sum(p.numel() for p in net.parameters())
        print("STEPBOUND " + json.dumps({"config": config, "step_s": statistics.median(times[warm:]),
                                         "params": params}), flush=True)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.codecs.step_bound", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link", default="1gbit")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warm", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3, help="every configuration once per round (default 3)")
    parser.add_argument("--rank", help=argparse.SUPPRESS)  # (internal: one rank's run)
    args = parser.parse_args(argv)
    if args.rank is not None:
        _rank(args.rank, args.steps, args.warm, args.width)
        return 0
    from benchmarks.harness.netem import Link, Network

    configs = args.configs.split(",")
    rounds: list[dict[str, dict]] = []
    with Network(2, Link(args.link)) as net:
        for r in range(args.rounds):  # every configuration once per round: drift hits all alike
            got: dict[str, dict] = {}
            for config in configs:
                print(f"  round {r + 1}/{args.rounds}: {config} at {args.link} ...", flush=True)
                cmd = [sys.executable, "-m", "benchmarks.codecs.step_bound", "--rank", config, "--steps",
                       str(args.steps), "--warm", str(args.warm), "--width", str(args.width)]
                result = net.run(cmd, timeout=600, echo=(), env={"OMP_NUM_THREADS": "1",
                                                                 "PYTHONPATH": os.getcwd()}).check()
                line = next(ln for ln in result.ranks[0].output.splitlines() if ln.startswith("STEPBOUND "))
                got[config] = json.loads(line[len("STEPBOUND "):])
            rounds.append(got)
    params = next(iter(rounds[0].values()))["params"]
    print(f"\n2 ranks, {args.link}, MLP of {params:,} parameters, median step over steps "
          f"{args.warm + 1}-{args.steps}, {args.rounds} round(s) (the median of the rounds; per round in brackets)\n")
    print("| configuration | step ms | × DDP bf16 | of bound |\n|---|---:|---:|---:|")
    for config in configs:
        steps = [got[config]["step_s"] for got in rounds]
        row = [f"| {config} | {1e3 * statistics.median(steps):.1f} ({', '.join(f'{1e3 * s:.1f}' for s in steps)})"]
        for other, fmt in zip(OF[config][::-1], ("{:.2f}×", "{:.2f}")):  # × DDP bf16, then of bound
            if other in configs:
                each = [got[other]["step_s"] / got[config]["step_s"] for got in rounds]
                row.append(fmt.format(statistics.median(each)) + " (" + ", ".join(f"{e:.2f}" for e in each) + ")")
            else:
                row.append("–")
        print(" | ".join(row) + " |")
    if all(c in configs for c in CONFIGS):
        each = [(got["adamw_local"]["step_s"] / got["onebit_adam"]["step_s"])
                / (got["lion_local"]["step_s"] / got["lion_1bit"]["step_s"]) for got in rounds]
        print(f"\n1-bit Adam's fraction of its bound / Lion Cub 1-bit's: {statistics.median(each):.2f} "
              f"(per round: {', '.join(f'{e:.2f}' for e in each)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
