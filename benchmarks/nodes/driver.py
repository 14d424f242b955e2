"""Multi-node end to end: the GPT of :mod:`benchmarks.e2e.driver` on N nodes x L ranks
(default 2 x 2) of :mod:`benchmarks.harness.netem`, a fast link inside each node (its loopback:
unshaped) and a shaped one between nodes, for DDP (fp32 allreduce) and every registered
algorithm (``lowbit_strategy.algorithms.REGISTRY``), per link and per
``LowBitConfig.topology``.

Each run is one :mod:`benchmarks.e2e.worker` training run (the same worker, seed, model,
data and steady-state window as :mod:`benchmarks.e2e.driver`), with torchrun's node variables
(``LOCAL_WORLD_SIZE``, ``NODE_RANK``): Lightning is built with ``devices=L,
num_nodes=N``. Per link, the two calibration runs (``calib_lion``, ``calib_adamw``: a comm
hook keeps every gradient local) give the comm-free bound each row is compared with.

Measured per row: **step ms** (rank 0's steady-state step time), **of bound** (the same
optimizer's calibration step time / step time: 1.00 = communication costs nothing),
**cross-node kB/step per node**: bytes per step on each node's shaped link (the qdisc
counters, Ethernet frames with TCP/IP headers; max over directions), i.e. only what
crossed nodes; the ranks of a node talk over loopback and are not in it.

Topologies: ``--topologies flat hierarchical`` passes ``LOWBIT_TOPOLOGY`` and the
``topology`` override to the ranks of the lowbit configurations (DDP and the
calibrations do not depend on it and run once per link). Without a ``topology`` field in
``LowBitConfig`` (before it landed) only ``flat`` runs, and nothing is passed.

Usage (root needed)::

    python -m benchmarks.nodes --quick        # ~10 min: 20 s per run -> results/nodes/nodes_quick.{json,md}
    python -m benchmarks.nodes                # ~20 min: 40 s per run -> results/nodes/nodes.{json,md}
    python -m benchmarks.nodes --links 100mbit --algorithms lion,bitdp --topologies flat hierarchical

``--sharded``: FSDP2 inside each node, HSDP's all-reduce or a sharded algorithm across nodes
(:mod:`benchmarks.nodes.sharded`; ``--sharded --world``: one FSDP group over every rank, exact
and quantized reduce-scatter; ``--sharded --project`` its cost-model projection)::

    python -m benchmarks.nodes --sharded         # ~13 min -> results/nodes/nodes_sharded.{json,md}
    python -m benchmarks.nodes --sharded --world # ~20 min -> results/nodes/nodes_sharded_world.{json,md,png}
    python -m benchmarks.nodes --sharded --project
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.e2e import report
from benchmarks.e2e import runs as e2e
from benchmarks.e2e.worker import CONFIGS, available
from benchmarks.harness.host import RESULTS, machine, parse_link
from benchmarks.harness.netem import NetemError, Network, require_root
#: DDP's fp32 allreduce: what "vs DDP" divides by
FP32 = ("ddp_lion", "ddp_adamw")
#: what users would run instead (:mod:`benchmarks.harness.baselines`): fp32, bf16 communication (torch's
#: ``bf16_compress_hook``: "vs DDP bf16"), PowerSGD rank 4; each with Lion and with AdamW
BASELINES = (*FP32, "ddp_bf16_lion", "ddp_bf16_adamw", "ddp_powersgd_lion", "ddp_powersgd_adamw")
TOPOLOGIES = ("flat", "hierarchical")
QUICK = {"budget": 20.0, "warm": 20, "freeze_step": 15}
FULL = {"budget": 40.0, "warm": 40, "freeze_step": 30}


def algorithm_configs() -> dict[str, str | None]:
    """Registered algorithm -> the first :data:`CONFIGS` entry running one of its strategies."""
    from lowbit_strategy.algorithms import REGISTRY

    return {name: next((c for c, (kind, _) in CONFIGS.items() if kind in algo.strategy_names), None)
            for name, algo in REGISTRY.items()}


def without_hierarchical_form() -> set[str]:
    """Registered algorithms whose Sync has no hierarchical form (``topology='hierarchical'``
    is refused for them at setup): their hierarchical rows are not run."""
    from lowbit_strategy.algorithms import REGISTRY

    return {name for name, algo in REGISTRY.items() if not getattr(algo, "hierarchical", True)}


def topology_supported() -> bool:
    """Whether ``LowBitConfig`` has the ``topology`` field (else ``LOWBIT_TOPOLOGY`` is rejected)."""
    from lowbit_strategy.section import SHARED_FIELDS

    return "topology" in SHARED_FIELDS


def per_node_bytes(rec: dict, ranks_per_node: int) -> list[float]:
    """Cross-node bytes per step of each node: its link's wire counters, max of tx and rx
    (the worker's per-rank counters are its node's: read them at each node's first rank)."""
    per_rank = rec.get("per_rank") or []
    return [max(r["wire_tx"], r["wire_rx"]) for r in per_rank[::ranks_per_node]]


def plan_runs(configs: list[str], calib: list[str], links, topologies: list[str],
              flat_only: set[str] = frozenset()) -> list[tuple]:
    """(link, config, topology or None) in run order: calibration and DDP once per link;
    the configurations in ``flat_only`` only with the flat topology."""
    runs = []
    for link in links:
        runs += [(link, c, None) for c in calib]
        runs += [(link, c, None) for c in configs if not CONFIGS[c][0].startswith("lowbit_")]
        runs += [(link, c, t) for t in topologies for c in configs
                 if CONFIGS[c][0].startswith("lowbit_") and (t == "flat" or c not in flat_only)]
    return runs


def _bound(r: dict) -> float | None:
    return r["calib_compute_s"] / r["step_s"] if r.get("calib_compute_s") and not r.get("failed") else None


def table(records: list[dict]) -> str:
    """The markdown table: one row per (algorithm, topology, link)."""
    lines = ["| algorithm | config | topology | link | step ms | of bound | cross-node kB/step per node | "
             "vs DDP (same optimizer) | vs DDP bf16 | loss reached | other load |",
             "|---|---|---|---|---:|---:|---|---:|---:|---:|---:|"]
    ddp = {(r["link"], r["optimizer"]): r for r in records if r["config"] in FP32 and not r.get("failed")}
    bf16 = {(r["link"], r["optimizer"]): r for r in records if r["config"].startswith("ddp_bf16_")
            and not r.get("failed")}
    for r in records:
        if r["config"].startswith("calib_"):
            continue
        topo = r.get("topology") or "–"
        if r.get("failed"):
            lines.append(f"| {r.get('algorithm', '–')} | {r['config']} | {topo} | {r['link']} | FAILED"
                         f"{' (timed out)' if r.get('timed_out') else ''} | – | – | – | – | – | – |")
            continue
        family = report.CALIBRATION_OF.get(r["optimizer"], r["optimizer"])
        base = ddp.get((r["link"], family)) or ddp.get((r["link"], "lion"))
        half = bf16.get((r["link"], family))
        nodes = ", ".join(f"{b / 1e3:.1f}" for b in r.get("cross_node_bytes_per_node_per_step", []))
        speed = f"{base['step_s'] / r['step_s']:.2f}× ({base['config']})" if base and base is not r else "–"
        speed_bf16 = f"{half['step_s'] / r['step_s']:.2f}×" if half and half is not r else "–"
        plan = f" ({', '.join(report.plan_text(x) for x in r['plan'])})" if r.get("plan") else ""
        lines.append(f"| {r.get('algorithm', '–')} | {r['config']}{plan} | {topo} | {r['link']} | "
                     f"{r['step_s'] * 1e3:.1f} | {report.cell(_bound(r), fmt='{:.2f}')} | {nodes} | {speed} | {speed_bf16} | "
                     f"{r['loss_reached']:.3f} | {report.cell(r.get('other_load'), 100, '{:.0f} %')} |")
    calib = [f"{r['config']} {r['link']}: {r['step_s'] * 1e3:.1f} ms" for r in records
             if r["config"].startswith("calib_") and not r.get("failed")]
    return "\n".join(lines) + "\n\nComm-free bound (calibration runs): " + ("; ".join(calib) or "–") + "\n"


def markdown(data: dict) -> str:
    s = data["settings"]
    no_hier = s.get("without_hierarchical_form") if "hierarchical" in s["topologies"] else None
    flat_only = f"; flat only (no hierarchical form): {', '.join(no_hier)}" if no_hier else ""
    return (f"# Multi-node end to end: {s['nodes']} nodes × {s['ranks_per_node']} ranks\n\n"
            f"`{data['command']}` — {data['date']}; {s.get('total_seconds', '?')} s in all.\n\n"
            f"Machine: {data['machine']}\n\n"
            + (f"Run from {s['source']}.\n\n" if s.get("source") else "") +
            f"GPT {s['model']}; {s['budget_s']:g} s of training per run, steady-state window after step "
            f"{s['warm_steps']}; 1-bit Adam/LAMB freeze step and TurboQuant warm-up {s['freeze_step']}. "
            f"Links between nodes: {s['links']}; inside a node: loopback (unshaped). "
            f"Topologies: {s['topologies']}"
            f"{'' if s['topology_field'] else ' (LowBitConfig has no topology field yet: flat only)'}"
            f"{flat_only}.\n\n"
            + table(data["records"]) +
            "\n- **step ms**: rank 0's steady-state step time; **of bound**: the same optimizer's "
            "calibration step time (no gradient crosses the wire) ÷ step time (1-bit Adam/LAMB and "
            "TurboQuant use AdamW's).\n- **cross-node kB/step per node**: bytes per step on each node's "
            "shaped link (qdisc counters: frames with headers; max of the two directions; 1 kB = 1000 B). "
            "Traffic between the ranks of a node stays on its loopback and is not in it.\n"
            "- **vs DDP**: step time of DDP (fp32 allreduce) with the same optimizer family ÷ this "
            "step time; **vs DDP bf16**: the same with DDP + torch's `bf16_compress_hook` (half the bytes; "
            "benchmarks/harness/baselines.py).\n- **other load**: share of the machine's cores busy with anything but this "
            "benchmark during the run (other jobs, softirq): 4 ranks share 2 CPU cores, so read "
            "differences under ~20 % as noise, more where the other load is high. One run per row.\n")


def write(data: dict, stem: Path) -> None:
    report.annotate(data)
    Path(f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    Path(f"{stem}.md").write_text(markdown(data))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--sharded" in argv:  # its own options: benchmarks.nodes.sharded
        from benchmarks.nodes import sharded as nodes_sharded

        return nodes_sharded.main([a for a in argv if a != "--sharded"])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nodes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['budget']:g} s per run (default {FULL['budget']:g})")
    parser.add_argument("--sharded", action="store_true",
                        help="FSDP2 inside each node: python -m benchmarks.nodes --sharded --help")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--links", default="1gbit,100mbit", help="tc rates between nodes")
    parser.add_argument("--algorithms", default=None, help="comma-separated registered algorithms (default all)")
    parser.add_argument("--baselines", default=",".join(BASELINES), help=f"DDP configs, from {BASELINES}; '' for none")
    parser.add_argument("--topologies", nargs="+", default=["flat"], choices=TOPOLOGIES)
    parser.add_argument("--budget", type=float, default=None, help="training seconds per run")
    parser.add_argument("--warm", type=int, default=None, help="steps before the steady-state window")
    parser.add_argument("--freeze-step", type=int, default=None,
                        help=f"1-bit Adam/LAMB freeze step, TurboQuant warm-up (keep it below --warm; default "
                             f"{FULL['freeze_step']}, --quick {QUICK['freeze_step']})")
    parser.add_argument("--lowbit", default="", metavar="KEY=VALUE,...", help="more LowBitConfig overrides")
    parser.add_argument("--max-minutes", type=float, default=60.0, help="skip the runs left after this")
    parser.add_argument("--output", default=None, help="path stem (default benchmarks/results/nodes/nodes[_quick])")
    parser.add_argument("--quiet", action="store_true", help="no live output of rank 0")
    parser.add_argument("--report-only", action="store_true", help="rewrite the .md from the existing .json")
    for key in ("d_model", "layers", "heads", "seq", "batch", "val_batches", "data_mb", "seed", "log_every"):
        defaults = {"d_model": 128, "layers": 4, "heads": 4, "seq": 64, "batch": 8, "val_batches": 8,
                    "data_mb": 6.0, "seed": 0, "log_every": 2}
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(defaults[key]), default=defaults[key])
    args = parser.parse_args(argv)
    stem = Path(args.output) if args.output else RESULTS / "nodes" / ("nodes_quick" if args.quick else "nodes")
    if args.report_only:
        data = json.loads(Path(f"{stem}.json").read_text())
        Path(f"{stem}.md").write_text(markdown(data))
        return 0
    preset = QUICK if args.quick else FULL
    args.budget = args.budget or preset["budget"]
    args.warm = preset["warm"] if args.warm is None else args.warm
    args.freeze_step = preset["freeze_step"] if args.freeze_step is None else args.freeze_step

    by_algo = algorithm_configs()
    wanted = args.algorithms.split(",") if args.algorithms else list(by_algo)
    unknown = sorted(set(wanted) - set(by_algo))
    if unknown:
        parser.error(f"unknown algorithms {unknown}; registered: {sorted(by_algo)}")
    no_config = [a for a in wanted if by_algo[a] is None or not available(by_algo[a])]
    baselines = [b for b in args.baselines.split(",") if b]
    if set(baselines) - set(BASELINES):
        parser.error(f"--baselines: choose from {BASELINES}")
    configs = baselines + [by_algo[a] for a in wanted if a not in no_config]
    algo_of = {by_algo[a]: a for a in wanted if a not in no_config}
    has_field = topology_supported()
    topologies = list(dict.fromkeys(args.topologies)) if has_field else ["flat"]
    dropped = sorted(set(args.topologies) - set(topologies))
    links = [parse_link(t.strip()) for t in args.links.split(",")]
    calib = e2e.calibrations(configs)
    no_hier = sorted(without_hierarchical_form() & set(wanted)) if has_field else []
    runs = plan_runs(configs, calib, links, topologies, {by_algo[a] for a in no_hier})
    stem.parent.mkdir(parents=True, exist_ok=True)
    partial = stem.with_name(stem.name + ".rank0.tmp")
    try:
        require_root()
    except NetemError as err:
        print(f"benchmarks.nodes.driver: {err}", file=sys.stderr)
        return 2

    records: list[dict] = []
    data = {
        "command": " ".join(["python -m benchmarks.nodes", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
        "settings": {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
                     "links": {link.name: " ".join(link.qdisc()) for link in links},
                     "algorithms": {a: by_algo[a] for a in wanted}, "without_config": no_config,
                     "baselines": baselines, "calibrations": calib, "topologies": topologies,
                     "topology_field": has_field, "topologies_dropped": dropped,
                     "without_hierarchical_form": no_hier,
                     "budget_s": args.budget, "warm_steps": args.warm, "freeze_step": args.freeze_step,
                     "lowbit_overrides": args.lowbit or None,
                     "model": {k: getattr(args, k) for k in e2e.MODEL_ARGS}},
        "records": records,
    }
    print(f"nodes benchmark: {args.nodes} nodes x {args.ranks_per_node} ranks, links {[link.name for link in links]}, "
          f"topologies {topologies}{f' (dropped {dropped}: LowBitConfig has no topology field)' if dropped else ''}, "
          f"{len(runs)} runs of {args.budget:g} s; algorithms {algo_of}; "
          f"without an e2e config: {no_config or 'none'}"
          f"{f'; flat only (no hierarchical form): {no_hier}' if 'hierarchical' in topologies else ''}", flush=True)
    start, deadline = time.monotonic(), time.monotonic() + args.max_minutes * 60
    user_lowbit = args.lowbit
    try:
        with Network(nodes=args.nodes, ranks_per_node=args.ranks_per_node, link=links[0]) as net:
            for i, (link, config, topology) in enumerate(runs):
                label = f"({i + 1}/{len(runs)}) {link.name} {config}{f' [{topology}]' if topology else ''}"
                if time.monotonic() + args.budget + 30 > deadline:
                    print(f"[{time.monotonic() - start:7.1f}s] {label}: skipped (--max-minutes {args.max_minutes:g})",
                          flush=True)
                    records.append({"config": config, "link": link.name, "topology": topology, "failed": True,
                                    "skipped": True, "P": net.world_size, "optimizer": CONFIGS[config][1]})
                    continue
                if net.link != link:
                    net.set_link(link)
                env = {}
                args.lowbit = user_lowbit
                if topology and has_field:
                    env["LOWBIT_TOPOLOGY"] = topology
                    args.lowbit = ",".join(filter(None, [user_lowbit, f"topology={topology}"]))
                t0 = time.monotonic()
                print(f"[{t0 - start:7.1f}s] {label}: running", flush=True)
                rec = e2e.run_config(net, config, args, partial, echo=not args.quiet, env=env)
                rec.update(topology=topology, algorithm=algo_of.get(config, "DDP" if config in BASELINES else "–"),
                           nodes=net.nodes, ranks_per_node=net.ranks_per_node)
                if not rec.get("failed"):
                    rec["cross_node_bytes_per_node_per_step"] = per_node_bytes(rec, net.ranks_per_node)
                records.append(rec)
                what = (f"FAILED{' (timed out)' if rec.get('timed_out') else ''}" if rec.get("failed") else
                        f"{rec['steps']} steps, {rec['step_s'] * 1e3:.1f} ms/step, cross-node "
                        f"{'/'.join(f'{b / 1e3:.1f}' for b in rec['cross_node_bytes_per_node_per_step'])} "
                        f"kB/step per node, loss {rec['loss_reached']:.3f}")
                print(f"[{time.monotonic() - start:7.1f}s] {label}: {what} in {time.monotonic() - t0:.1f}s",
                      flush=True)
                data["settings"]["total_seconds"] = round(time.monotonic() - start, 1)
                write(data, stem)
    except NetemError as err:
        print(f"benchmarks.nodes.driver: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("benchmarks.nodes.driver: interrupted; ranks killed, namespaces removed", file=sys.stderr)
        return 130
    data["settings"]["total_seconds"] = round(time.monotonic() - start, 1)
    write(data, stem)
    print(table(records), flush=True)
    print(f"[{time.monotonic() - start:7.1f}s] wrote {stem}.json, {stem}.md", flush=True)
    return 0 if not any(r.get("failed") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
