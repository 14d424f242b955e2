"""One synchronization of N float32 values, per algorithm, on emulated 1 Gbit/s, 100 Mbit/s
and unshaped links, P = 2 and 4 ranks: time, bytes on the wire, recorded bytes, the cost
model's prediction and the physical bound.

Compares what users would otherwise run (DDP's fp32 allreduce, ``fp16_compress_hook``,
PowerSGD rank 1 and 4) with this package's collectives (Lion Cub 1-bit majority vote,
p-bit summed allreduce of sign votes and of L1-quantized codes) in the same run. Each
(P, link) configuration starts P processes in :mod:`benchmarks.harness.netem` namespaces running
:mod:`benchmarks.collectives.worker`; see there for exactly what is timed.

* time: median over ``--reps`` synchronizations (after ``--warmup``) of the slowest rank;
* wire bytes / rank: max over ranks and directions of the shaping qdiscs' byte counts
  (Ethernet frames incl. TCP/IP headers and ACKs); the veths' own counters are kept too;
* recorded bytes / rank: what the code recorded (``lowbit_strategy.collectives.recording``);
* model: ``lowbit_strategy.pricing.estimate`` with the link rate and α measured as a
  4-byte allreduce's time / (2·ceil(log2 P));
* bound: wire bytes / link rate, the fastest the shaped link could carry those bytes.

Usage (root needed)::

    python -m benchmarks.collectives --quick     # ~2 min: N = 64Ki, 1Mi; -> results/collectives/collectives_quick.*
    python -m benchmarks.collectives             # N = 1Mi, 4Mi, 16Mi; -> results/collectives/collectives.*
    python -m benchmarks.collectives -P 4 --links 100mbit --sizes 4194304 --output /tmp/x
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


from benchmarks.collectives import report
from benchmarks.collectives.worker import MODEL_NAMES
from benchmarks.harness.host import RESULTS, ROOT, machine, parse_link
from benchmarks.harness.netem import Link, Network, NetemError, require_root

FULL = {"sizes": [1 << 20, 1 << 22, 1 << 24], "reps": 5, "warmup": 1}
QUICK = {"sizes": [1 << 16, 1 << 20], "reps": 3, "warmup": 1}


def run_config(net: Network, link: Link, args, partial: Path, echo: bool) -> list[dict]:
    """Run the worker on every rank of ``net`` shaped as ``link``; its records."""
    net.set_link(link)
    partial.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.collectives.worker", "--sizes", ",".join(map(str, args.sizes)),
           "--algorithms", ",".join(args.algorithms), "--reps", str(args.reps), "--warmup", str(args.warmup),
           "--out", str(partial), "--timeout", str(args.timeout)]
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONPATH": str(ROOT)}
    result = net.run(cmd, timeout=args.timeout, env=env, echo=(0,) if echo else (), cwd=str(ROOT))
    result.check()
    records = [json.loads(line) for line in partial.read_text().splitlines() if line.strip()]
    partial.unlink()
    for r in records:
        r["run_seconds"] = result.seconds
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.collectives", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"small sizes {QUICK['sizes']}, {QUICK['reps']} reps")
    parser.add_argument("-P", "--world-sizes", default="2,4", help="comma-separated rank counts (default 2,4)")
    parser.add_argument("--links", default="1gbit,100mbit,unshaped", help="tc rates or 'unshaped'")
    parser.add_argument("--sizes", default=None, help="comma-separated N (overrides --quick's/the full set)")
    parser.add_argument("--algorithms", default=",".join(MODEL_NAMES))
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600, help="per (P, link) run, seconds")
    parser.add_argument("--output", default=None,
                        help="path stem for .json/.md/.png (default benchmarks/results/collectives/collectives[_quick])")
    parser.add_argument("--quiet", action="store_true", help="only one line per configuration")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    args.sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else preset["sizes"]
    args.reps = args.reps or preset["reps"]
    args.warmup = preset["warmup"] if args.warmup is None else args.warmup
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = sorted(set(args.algorithms) - set(MODEL_NAMES))
    if unknown:
        parser.error(f"unknown algorithms {unknown}; choose from {list(MODEL_NAMES)}")
    world_sizes = [int(p) for p in args.world_sizes.split(",")]
    links = [parse_link(t.strip()) for t in args.links.split(",")]
    stem = Path(args.output) if args.output else RESULTS / "collectives" / ("collectives_quick" if args.quick else "collectives")
    stem.parent.mkdir(parents=True, exist_ok=True)
    partial = stem.with_name(stem.name + ".jsonl.tmp")
    try:
        require_root()
    except NetemError as err:
        print(f"benchmarks.collectives.driver: {err}", file=sys.stderr)
        return 2

    start, records = time.monotonic(), []
    print(f"collectives benchmark: P={world_sizes} links={[l.name for l in links]} N={args.sizes} "
          f"reps={args.reps} warmup={args.warmup}", flush=True)
    try:
        for p in world_sizes:
            with Network(p) as net:
                for link in links:
                    t0 = time.monotonic()
                    print(f"[{time.monotonic() - start:7.1f}s] P={p} {link.name}: running", flush=True)
                    records += run_config(net, link, args, partial, echo=not args.quiet)
                    print(f"[{time.monotonic() - start:7.1f}s] P={p} {link.name}: done in "
                          f"{time.monotonic() - t0:.1f}s", flush=True)
    except NetemError as err:
        print(f"benchmarks.collectives.driver: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("benchmarks.collectives.driver: interrupted; ranks killed, namespaces removed", file=sys.stderr)
        return 130
    data = {
        "command": " ".join(["python -m benchmarks.collectives", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
        "settings": {"world_sizes": world_sizes, "links": {l.name: " ".join(l.qdisc()) for l in links},
                     "sizes": args.sizes, "reps": args.reps, "warmup": args.warmup, "mtu": 1500,
                     "algorithms": args.algorithms, "total_seconds": round(time.monotonic() - start, 1)},
        "records": records,
    }
    Path(f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    Path(f"{stem}.md").write_text(report.markdown(data))
    report.plot(data, Path(f"{stem}.png"))
    print(f"[{time.monotonic() - start:7.1f}s] wrote {stem}.json, .md, .png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
