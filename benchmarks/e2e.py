"""End to end: the GPT of ``examples/gpt_lion.py`` trained for a fixed wall-clock budget on
P ranks over emulated 1 Gbit/s and 100 Mbit/s links, with what users would otherwise run
(:mod:`benchmarks.baselines`: DDP fp32 allreduce, torch's ``bf16_compress_hook``,
``fp16_compress_hook`` and PowerSGD, each with Lion or AdamW) next to
this package's strategies (``lowbit_lion`` and its 1/4/8/32-bit variants; ``lowbit_bitdp``
and ``lowbit_bitdp_1bit`` with AdamW when that strategy is registered).

Every configuration is one run of P processes in :mod:`benchmarks.netem` namespaces
(``tbf`` links, no delay) running :mod:`benchmarks.e2e_worker` with the same seed, model
initialization and data order; see there for what is measured and how. Per (P, link), two
calibration runs first (``calib_lion``, ``calib_adamw``: a comm hook keeps every gradient
local) give the compute time per step that the DDP baselines' step time is split against.

Usage (root needed)::

    python -m benchmarks.e2e --quick     # ~5 min: P=4, 4 Lion configs + calibration, 15 s each -> results/e2e_quick.*
    python -m benchmarks.e2e             # ~40 min: P=4, all configs, 90 s each -> results/e2e.*
    python -m benchmarks.e2e -P 2 --links 100mbit --configs ddp_lion,lowbit_lion --budget 30 --output /tmp/x
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

from benchmarks import e2e_report as report
from benchmarks.collectives import machine, parse_link
from benchmarks.e2e_worker import CONFIGS, POWERSGD, available
from benchmarks.netem import Network, NetemError, require_root

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MAIN = [name for name in CONFIGS if not name.startswith("calib_")]
FULL = {"configs": MAIN, "budget": 90.0, "warm": 20}
QUICK = {"configs": ["ddp_lion", "lowbit_lion", "lowbit_lion_1bit", "lowbit_lion_4bit"], "budget": 15.0, "warm": 12}
MODEL_ARGS = ("d_model", "layers", "heads", "seq", "batch", "val_batches", "data_mb", "seed", "log_every")


def calibrations(configs: list[str]) -> list[str]:
    """The calibration runs the DDP-hook configurations need (one per optimizer)."""
    opts = {report.CALIBRATION_OF.get(CONFIGS[c][1], CONFIGS[c][1]) for c in configs
            if CONFIGS[c][0] in ("ddp", "bf16", "fp16", "powersgd", "lowbit_bitdp", "lowbit_bitdp_1bit", "lowbit_adam",
                                 "lowbit_lamb", "lowbit_turboquant")}
    opts |= {CONFIGS[c][1] for c in configs if c.startswith("lowbit_lion")}  # codec overhead reference
    return [f"calib_{o}" for o in ("lion", "adamw") if o in opts]


def cpu_busy_s() -> float:
    """Seconds of CPU the whole machine spent busy since boot (all cores, /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its finished children (the ranks, once reaped)."""
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def run_config(net: Network, config: str, args, partial: Path, echo: bool, env: dict | None = None) -> dict:
    """One training run of ``config`` on every rank of ``net``; its record (or a failure).
    ``env``: more variables for the ranks (e.g. ``LOWBIT_TOPOLOGY`` from :mod:`benchmarks.nodes`).

    ``other_load``: the share of the machine's cores kept busy by anything but this
    benchmark's processes during the run: other users' jobs, and interrupt/softirq time
    (which includes the kernel's processing of this benchmark's own packets).
    """
    partial.unlink(missing_ok=True)
    busy0, own0, t0 = cpu_busy_s(), own_cpu_s(), time.monotonic()
    cmd = [sys.executable, "-m", "benchmarks.e2e_worker", "--config", config, "--budget", str(args.budget),
           "--warm", str(args.warm), "--out", str(partial), "--timeout", str(args.budget + 120)]
    for key in MODEL_ARGS:
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.lowbit:
        cmd += ["--lowbit", args.lowbit]
    cmd += ["--freeze-step", str(args.freeze_step)]
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", **(env or {})}
    result = net.run(cmd, timeout=args.budget + 240, env=env, echo=(0,) if echo else (), cwd=str(ROOT))
    wall = time.monotonic() - t0
    other = max(0.0, (cpu_busy_s() - busy0) - (own_cpu_s() - own0)) / (wall * (os.cpu_count() or 1))
    if not result.ok or not partial.exists():
        tails = {r.rank: r.output[-2000:] for r in result.ranks if r.returncode != 0} or \
                {0: result.ranks[0].output[-2000:]}
        return {"config": config, "P": net.world_size, "link": net.link.name, "failed": True,
                "timed_out": result.timed_out, "run_seconds": result.seconds, "other_load": other,
                "error": tails}
    rec = json.loads(partial.read_text())
    partial.unlink()
    rec["run_seconds"] = result.seconds
    rec["other_load"] = other
    rec["run_wire_bytes"] = max(max(r.counters.wire_tx, r.counters.wire_rx) for r in result.ranks)
    return rec


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
    parser.add_argument("--output", default=None, help="path stem (default benchmarks/results/e2e[_quick])")
    parser.add_argument("--quiet", action="store_true", help="no live output of rank 0")
    parser.add_argument("--report-only", action="store_true", help="rewrite .md/.png from the existing .json")
    args = parser.parse_args(argv)
    stem = Path(args.output) if args.output else RESULTS / ("e2e_quick" if args.quick else "e2e")
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
        print(f"benchmarks.e2e: {err}", file=sys.stderr)
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
        print(f"benchmarks.e2e: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("benchmarks.e2e: interrupted; ranks killed, namespaces removed", file=sys.stderr)
        return 130
    data["settings"]["total_seconds"] = round(time.monotonic() - start, 1)
    write_report(data, stem)
    print(f"[{time.monotonic() - start:7.1f}s] wrote {stem}.json, .md, _loss.png, _split.png", flush=True)
    return 0 if not any(r.get("failed") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
