"""End to end: the GPT of ``examples/gpt_lion.py`` trained for a fixed wall-clock budget on
P ranks over emulated 1 Gbit/s and 100 Mbit/s links, with what users would otherwise run
(:mod:`benchmarks.harness.baselines`: DDP fp32 allreduce, torch's ``bf16_compress_hook``,
``fp16_compress_hook`` and PowerSGD, each with Lion or AdamW) next to
this package's strategies (``lowbit_lion`` and its 1/4/8/32-bit variants; ``lowbit_bitdp``
and ``lowbit_bitdp_1bit`` with AdamW when that strategy is registered).

Every configuration is one run of P processes in :mod:`benchmarks.harness.netem` namespaces
(``tbf`` links, no delay) running :mod:`benchmarks.e2e.worker` with the same seed, model
initialization and data order; see there for what is measured and how. Per (P, link), two
calibration runs first (``calib_lion``, ``calib_adamw``: a comm hook keeps every gradient
local) give the compute time per step that the DDP baselines' step time is split against.

Usage (root needed)::

    python -m benchmarks.e2e --quick     # ~5 min: P=4, 4 Lion configs + calibration, 15 s each -> results/e2e/e2e_quick.*
    python -m benchmarks.e2e             # ~40 min: P=4, all configs, 90 s each -> results/e2e/e2e.*
    python -m benchmarks.e2e -P 2 --links 100mbit --configs ddp_lion,lowbit_lion --budget 30 --output /tmp/x
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.e2e import report
from benchmarks.e2e.runs import MODEL_ARGS, calibrations, run_config
from benchmarks.e2e.worker import CONFIGS, POWERSGD, available
from benchmarks.harness.host import RESULTS, machine, parse_link
from benchmarks.harness.netem import Network, NetemError, require_root

MAIN = [name for name in CONFIGS if not name.startswith("calib_")]
FULL = {"configs": MAIN, "budget": 90.0, "warm": 20}
QUICK = {"configs": ["ddp_lion", "lowbit_lion", "lowbit_lion_1bit", "lowbit_lion_4bit"], "budget": 15.0, "warm": 12}


def write_report(data: dict, stem: Path) -> None:
    data = report.annotate(data)
    Path(f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    Path(f"{stem}.md").write_text(report.markdown(data))
    report.plot_loss(data, Path(f"{stem}_loss.png"))
    report.plot_split(data, Path(f"{stem}_split.png"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.e2e", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"configs {QUICK['configs']}, {QUICK['budget']:g} s each")
    parser.add_argument("-P", "--world-sizes", default="4", help="comma-separated rank counts (default 4)")
    parser.add_argument("--links", default="1gbit,100mbit", help="tc rates or 'unshaped'")
    parser.add_argument("--configs", default=None, help=f"comma-separated, from {MAIN}")
    parser.add_argument("--budget", type=float, default=None, help="training seconds per run")
    parser.add_argument("--warm", type=int, default=None, help="steps before the steady-state window")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="per rank")
    parser.add_argument("--val-batches", type=int, default=8, help="per rank")
    parser.add_argument("--data-mb", type=float, default=6.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=2, help="loss-curve points every k steps")
    parser.add_argument("--freeze-step", type=int, default=100,
                        help="1-bit Adam/LAMB warm-up steps; keep --warm past it to time the compression stage")
    parser.add_argument("--lowbit", default="", metavar="KEY=VALUE,...",
                        help="LowBitConfig overrides for every lowbit_* configuration, e.g. bucket_size_mb=1")
    parser.add_argument("--output", default=None, help="path stem (default benchmarks/results/e2e/e2e[_quick])")
    parser.add_argument("--quiet", action="store_true", help="no live output of rank 0")
    parser.add_argument("--report-only", action="store_true", help="rewrite .md/.png from the existing .json")
    args = parser.parse_args(argv)
    stem = Path(args.output) if args.output else RESULTS / "e2e" / ("e2e_quick" if args.quick else "e2e")
    if args.report_only:
        write_report(json.loads(Path(f"{stem}.json").read_text()), stem)
        return 0
    preset = QUICK if args.quick else FULL
    configs = args.configs.split(",") if args.configs else preset["configs"]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {MAIN}")
    skipped = [c for c in configs if not available(c)]
    configs = [c for c in configs if available(c)]
    args.budget = args.budget or preset["budget"]
    args.warm = preset["warm"] if args.warm is None else args.warm
    world_sizes = [int(p) for p in args.world_sizes.split(",")]
    links = [parse_link(t.strip()) for t in args.links.split(",")]
    stem.parent.mkdir(parents=True, exist_ok=True)
    partial = stem.with_name(stem.name + ".rank0.tmp")
    try:
        require_root()
    except NetemError as err:
        print(f"benchmarks.e2e.driver: {err}", file=sys.stderr)
        return 2

    calib = calibrations(configs)
    plan = [(p, link, c) for p in world_sizes for link in links for c in calib + configs]
    start, records = time.monotonic(), []
    data = {
        "command": " ".join(["python -m benchmarks.e2e", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
        "settings": {"world_sizes": world_sizes, "links": {l.name: " ".join(l.qdisc()) for l in links},
                     "configs": configs, "skipped_unregistered": skipped, "calibrations": calib,
                     "budget_s": args.budget, "warm_steps": args.warm,
                     "lowbit_overrides": args.lowbit or None, "freeze_step": args.freeze_step,
                     "powersgd": POWERSGD, "mtu": 1500,
                     "model": {k: getattr(args, k) for k in MODEL_ARGS}},
        "records": records,
    }
    print(f"e2e benchmark: P={world_sizes} links={[l.name for l in links]} budget={args.budget:g}s "
          f"runs={len(plan)} (calibration {calib}); skipped (not registered): {skipped or 'none'}", flush=True)
    try:
        for p in world_sizes:
            with Network(p) as net:
                for i, (pp, link, config) in enumerate(plan):
                    if pp != p:
                        continue
                    if net.link != link:
                        net.set_link(link)
                    t0 = time.monotonic()
                    print(f"[{t0 - start:7.1f}s] ({i + 1}/{len(plan)}) P={p} {link.name} {config}: running",
                          flush=True)
                    rec = run_config(net, config, args, partial, echo=not args.quiet)
                    records.append(rec)
                    what = (f"FAILED{' (timed out)' if rec.get('timed_out') else ''}" if rec.get("failed") else
                            f"{rec['steps']} steps, {rec['step_s'] * 1e3:.1f} ms/step, "
                            f"wire {rec['wire_bytes_per_step'] / 1e3:.1f} kB/step, loss {rec['loss_reached']:.3f}")
                    print(f"[{time.monotonic() - start:7.1f}s] ({i + 1}/{len(plan)}) P={p} {link.name} {config}: "
                          f"{what} in {time.monotonic() - t0:.1f}s", flush=True)
                    data["settings"]["total_seconds"] = round(time.monotonic() - start, 1)
                    Path(f"{stem}.json").write_text(json.dumps(report.annotate(data), indent=1) + "\n")
    except NetemError as err:
        print(f"benchmarks.e2e.driver: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("benchmarks.e2e.driver: interrupted; ranks killed, namespaces removed", file=sys.stderr)
        return 130
    data["settings"]["total_seconds"] = round(time.monotonic() - start, 1)
    write_report(data, stem)
    print(f"[{time.monotonic() - start:7.1f}s] wrote {stem}.json, .md, _loss.png, _split.png", flush=True)
    return 0 if not any(r.get("failed") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
