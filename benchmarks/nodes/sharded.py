"""Sharded multi-node end to end: FSDP2 inside each node, the exchange across nodes by HSDP's
all-reduce (fp32, bf16) or by a sharded algorithm (:func:`lowbit_strategy.attach_sharded`),
on N nodes x L ranks (default 2 x 2) of :mod:`benchmarks.harness.netem` as :mod:`benchmarks.nodes.driver`
emulates them: each node's ranks share a namespace (their FSDP traffic stays on its
loopback), nodes are joined by shaped links (default 1 Gbit/s and 100 Mbit/s).

Each run is one :mod:`benchmarks.nodes.sharded_worker` training run of the e2e GPT (same model,
data, seed and optimizers as :mod:`benchmarks.e2e.driver`; ``--model mlp``:
:mod:`benchmarks.nodes.sharded_mlp`'s MLP, whose exchange weighs more against its compute);
configurations :data:`CONFIGS`:
``hsdp_fp32`` and ``hsdp_bf16`` (AdamW; the all-reduce of every unit's gradient shard across
nodes from its all-reduce hook, as HSDP does), ``lion_1bit``, ``lion_auto`` (Lion Cub),
``onebit_adam`` and ``turboquant`` (its ``auto`` form), their exchange started during backward
(the default), and ``*_step`` the same with it in ``optimizer.step()`` (the section's
``overlap=False``), side by side; ``node_only``, the comm-free bound (FSDP2 inside each node,
nothing across nodes: not a method; every row's step time as a fraction of it, "of bound");
and one FSDP group over all N·L
ranks (``fsdp_fp32``: FSDP's exact reduce-scatter; ``fsdp_int8``, ``fsdp_int4``: the quantized
one, one hop; ``fsdp_int4_2hop``: two hops, exact inside the node), where FSDP's all-gathers
and reduce-scatter cross nodes (``--world`` runs these beside HSDP bf16 and the 1-bit rows).

Reported per row: steady-state **step ms** (rank 0's clock); **cross-node bytes per node per
step** on the shaped link (qdisc counters: frames with headers, max of the two directions,
as :mod:`benchmarks.nodes.driver` reads them), as the ranks' traffic logs recorded them (network
scope, summed over the node's ranks) and as the cost model predicts both
(:mod:`lowbit_strategy.pricing.sharded`, ``cost_model_world`` for one FSDP
group over every rank, where a flat ring or all-to-all logs bytes that stay in the node);
**state bytes per rank** (optimizer state and communicator error buffers, local tensors); the
ratios of bytes and step time against the HSDP fp32 and bf16 rows of the same link; the
training loss (last 20 steps) and a validation loss at the end, after an equal **budget** of
training seconds per run (not equal steps).

Usage (root needed for the runs; ``--project`` needs nothing)::

    python -m benchmarks.nodes --sharded             # ~22 min: 20 runs of 40 s -> results/nodes/nodes_sharded.{json,md}
    python -m benchmarks.nodes --sharded --model mlp --d-model 1024 --layers 3 --batch 16 \
        --output benchmarks/results/nodes/nodes_sharded_mlp   # the 12.6M-parameter MLP
    python -m benchmarks.nodes --sharded --quick     # ~9 min: 20 s per run -> results/nodes/nodes_sharded_quick.*
    python -m benchmarks.nodes --sharded --world     # ~20 min: 14 runs of 60 s -> results/nodes/nodes_sharded_world.*
    python -m benchmarks.nodes --sharded --project   # cost-model projection -> results/nodes/nodes_sharded_projection.*
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

from benchmarks.harness.host import RESULTS, ROOT, cpu_busy_s, machine, own_cpu_s, parse_link
from benchmarks.harness.netem import NetemError, Network, require_root
from benchmarks.nodes.sharded_worker import CONFIGS

#: as benchmarks.nodes.driver: 1-bit Adam diverged on this GPT with freeze_step 15 (its variance frozen too young)
QUICK = {"budget": 20.0, "warm": 20, "freeze_step": 15}
FULL = {"budget": 40.0, "warm": 40, "freeze_step": 30}
#: --world: one FSDP group over every rank against HSDP bf16 and the 1-bit rows; 60 s, so that
#: the slowest row (FSDP fp32 at 100 Mbit/s, ~1 s/step) keeps ~20 steps after the warm-up
WORLD = {"budget": 60.0, "warm": 35, "freeze_step": 30,
         "configs": ("hsdp_bf16", "lion_1bit", "onebit_adam", "fsdp_fp32", "fsdp_int8", "fsdp_int4", "fsdp_int4_2hop")}
MODEL_ARGS = {"model": "gpt", "d_model": 128, "layers": 4, "heads": 4, "seq": 64, "batch": 8, "data_mb": 6.0, "seed": 0}
BASELINES = ("hsdp_fp32", "hsdp_bf16")
#: the comm-free bound's row: every row's step time as a fraction of it ("of bound")
BOUND = "node_only"
LABELS = {"hsdp_fp32": "HSDP fp32 all-reduce + AdamW", "hsdp_bf16": "HSDP bf16 all-reduce + AdamW",
          "lion_1bit": "Lion Cub 1-bit", "lion_auto": "Lion Cub auto", "onebit_adam": "1-bit Adam", "onebit_lamb": "1-bit LAMB",
          "turboquant": "TurboQuant-Adam (auto form)", "lion_1bit_step": "Lion Cub 1-bit, exchange at step()",
          "onebit_adam_step": "1-bit Adam, exchange at step()", "turboquant_step": "TurboQuant-Adam, exchange at step()",
          "node_only": "comm-free bound (FSDP2 in the node only)", "fsdp_fp32": "FSDP world, exact reduce-scatter + AdamW",
          "fsdp_int8": "FSDP world, int8 reduce-scatter + AdamW",
          "fsdp_int4": "FSDP world, int4 reduce-scatter + AdamW",
          "fsdp_int4_2hop": "FSDP world, int4 two-hop reduce-scatter + AdamW"}


def run_config(net: Network, config: str, args, partial: Path, echo: bool) -> dict:
    """One training run of ``config`` on every rank of ``net``: its record, or a failure."""
    partial.unlink(missing_ok=True)
    busy0, own0, t0 = cpu_busy_s(), own_cpu_s(), time.monotonic()
    cmd = [sys.executable, "-m", "benchmarks.nodes.sharded_worker", "--config", config, "--budget", str(args.budget),
           "--warm", str(args.warm), "--freeze-step", str(args.freeze_step), "--out", str(partial),
           "--timeout", str(args.budget + 120)]
    for key in MODEL_ARGS:
        cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    result = net.run(cmd, timeout=args.budget + 240, env=env, echo=(0,) if echo else (), cwd=str(ROOT))
    wall = time.monotonic() - t0
    other = max(0.0, (cpu_busy_s() - busy0) - (own_cpu_s() - own0)) / (wall * (os.cpu_count() or 1))
    if not result.ok or not partial.exists():
        tails = {r.rank: r.output[-2000:] for r in result.ranks if r.returncode != 0} or \
                {0: result.ranks[0].output[-2000:]}
        return {"config": config, "link": net.link.name, "failed": True, "timed_out": result.timed_out,
                "run_seconds": result.seconds, "other_load": other, "error": tails}
    rec = json.loads(partial.read_text())
    partial.unlink()
    rec.update(run_seconds=result.seconds, other_load=other, link=net.link.name)
    return rec


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs) if xs else 0.0


def table(records: list[dict]) -> str:
    """One row per (link, configuration), with the ratios against the HSDP rows of its link."""
    lines = ["| configuration | plan | link | step ms | link kB/node/step | cost model kB (link) | logged kB | "
             "cost model kB (logged) | state kB/rank (errors) | vs HSDP fp32: bytes, speed | "
             "vs HSDP bf16: bytes, speed | of bound | train loss | val loss | other load |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {(r["link"], r["config"]): r for r in records
            if r["config"] in (*BASELINES, BOUND) and not r.get("failed")}
    for r in records:
        label = LABELS.get(r["config"], r["config"])
        if r.get("failed"):
            why = "skipped" if r.get("skipped") else "timed out" if r.get("timed_out") else "FAILED"
            lines.append(f"| {label} | – | {r['link']} | {why} |" + " – |" * 11)
            continue
        link = _mean(r["cross_node_bytes_per_node_per_step"])
        ratios = []
        for b in BASELINES:
            h = base.get((r["link"], b))
            # (the comm-free row sends nothing but the harness's per-step flag: no byte ratio)
            bound_row = r["config"] == BOUND
            fewer = "–" if bound_row or not h else f"{_mean(h['cross_node_bytes_per_node_per_step']) / link:.2f}×"
            ratios.append("–" if h is None or h is r else f"{fewer}, {h['step_s'] / r['step_s']:.2f}×")
        bound = base.get((r["link"], BOUND))
        of_bound = "–" if bound is None else f"{bound['step_s'] / r['step_s']:.2f}"
        state = _mean(r["state_bytes_per_rank"]) / 1e3
        errors = _mean(r["state_error_bytes_per_rank"]) / 1e3
        val = r.get("val_loss")
        lines.append(
            f"| {label} | {r.get('plan') or '–'} | {r['link']} | {r['step_s'] * 1e3:.1f} | {link / 1e3:,.1f} | "
            f"{r['model_bytes_per_node'] / 1e3:,.1f} | {_mean(r['logged_bytes_per_node_per_step']) / 1e3:,.1f} | "
            f"{r.get('model_logged_bytes_per_node', r['model_bytes_per_node']) / 1e3:,.1f} | "
            f"{state:,.0f} ({errors:,.0f}) | {ratios[0]} | {ratios[1]} | {of_bound} | {r['loss_reached']:.3f} | "
            f"{'–' if val is None else f'{val:.3f}'} | {100 * r.get('other_load', 0):.0f} % |")
    return "\n".join(lines) + "\n"


def markdown(data: dict) -> str:
    s = data["settings"]
    return (
        f"# Sharded multi-node end to end: {s['nodes']} nodes × {s['ranks_per_node']} ranks\n\n"
        f"`{data['command']}` — {data['date']}; {s.get('total_seconds', '?')} s in all.\n\n"
        f"Machine: {data['machine']}\n\n"
        f"{s['model'].get('model', 'gpt').upper()} {s['model']} ({s.get('params', '?')} parameters), "
        "FSDP2 inside each node (every block, then the "
        f"root, over the node's ranks; the FSDP world rows: over all {s['nodes'] * s['ranks_per_node']} ranks); "
        f"{s['budget_s']:g} s of training per run (equal budget, not equal steps), steady-state window after step "
        f"{s['warm_steps']}; 1-bit Adam freeze step and TurboQuant warm-up {s['freeze_step']}. Links between nodes: "
        f"{s['links']}; inside a node: loopback (unshaped).\n\n" + table(data["records"]) +
        "\n- **link kB/node/step**: bytes per step on each node's shaped link (qdisc counters: frames with TCP/IP "
        "headers, max of the two directions, mean of the nodes; 1 kB = 1000 B). In the HSDP and sharded rows "
        "FSDP's reduce-scatter and all-gather stay inside the node and are not in it; in the FSDP world rows they "
        "are all of it. **logged**: what the ranks' traffic logs recorded as network traffic in the window, summed "
        "over a node's ranks (FSDP world rows: the quantized reduce-scatter logs itself, a recorder logs FSDP's own "
        "all-gathers and exact reduce-scatter; a flat ring or all-to-all logs bytes to same-node peers too, so "
        "logged exceeds the link there); **cost model**: `lowbit_strategy.pricing.sharded` and "
        "`cost_model_world` (gloo's reduce-scatter is an allreduce) for this model and plan, on the link and as "
        "logged (the payload, no headers; the harness's 4-byte budget broadcast and the staged optimizers' 4-byte "
        "step agreement are in neither).\n"
        "- **state kB/rank**: optimizer state plus the communicator's error buffers (in brackets), local tensors, "
        "mean over ranks: each rank holds ~1/L of the model's.\n"
        "- **vs HSDP**: the HSDP row's link bytes ÷ this row's (how many times fewer bytes), and its step time ÷ "
        "this row's (speed-up). HSDP and the Adam-family rows use AdamW's arithmetic; Lion Cub's are Lion's.\n"
        "- **of bound**: the comm-free row's step time ÷ this row's (FSDP2 inside each node, nothing across nodes: "
        "what no method can beat; its nodes train apart, so its losses say nothing). The sharded algorithms start their exchange during backward; the rows "
        "marked 'exchange at step()' run it in `optimizer.step()` (the section's `overlap=False`), side by side. "
        "HSDP's rows all-reduce from FSDP2's hook, which on CPU (gloo, no streams) blocks backward.\n"
        "- **train loss**: mean of the last 20 steps' losses over ranks; **val loss**: the held-out 10 % of the "
        "data at the end (8 batches per rank).\n"
        "- **other load**: share of the machine's cores busy with anything but this benchmark during the run: "
        "4 ranks share 2 CPU cores, so read step-time differences under ~20 % as noise. One run per row.\n")


def write(data: dict, stem: Path, final: bool = False) -> None:
    Path(f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    Path(f"{stem}.md").write_text(markdown(data))
    if final:
        plot(data, Path(f"{stem}.png"))


def plot(data: dict, path: Path) -> None:
    """Step time, link bytes and validation loss per configuration and link (no plot without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    records = [r for r in data["records"] if not r.get("failed")]
    configs = list(dict.fromkeys(r["config"] for r in records))
    links = list(dict.fromkeys(r["link"] for r in records))
    panels = (("step ms", lambda r: r["step_s"] * 1e3, False),
              ("link kB/node/step (log)", lambda r: _mean(r["cross_node_bytes_per_node_per_step"]) / 1e3, True),
              ("val loss", lambda r: r.get("val_loss") or r["loss_reached"], False))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    width = 0.8 / max(1, len(links))
    for ax, (title, value, log) in zip(axes, panels):
        for k, link in enumerate(links):
            got = {r["config"]: value(r) for r in records if r["link"] == link}
            xs = [i + (k - (len(links) - 1) / 2) * width for i in range(len(configs))]
            ax.bar(xs, [got.get(c, 0) for c in configs], width, label=link)
        ax.set_xticks(range(len(configs)), configs, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
        lows = [v for v in (value(r) for r in records) if math.isfinite(v)]
        if title == "val loss" and lows:
            ax.set_ylim(min(lows) - 0.2, max(lows) + 0.1)
    axes[0].legend(fontsize=8)
    s = data["settings"]
    fig.suptitle(f"Sharded end to end, {s['nodes']} nodes x {s['ranks_per_node']} ranks, "
                 f"{s['budget_s']:g} s per run", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.nodes --sharded", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK['budget']:g} s per run (default {FULL['budget']:g})")
    parser.add_argument("--project", action="store_true", help="write the cost-model projection only (no runs)")
    parser.add_argument("--world", action="store_true",
                        help=f"one FSDP group over every rank against HSDP bf16 and the 1-bit rows: "
                             f"{WORLD['configs']}, {WORLD['budget']:g} s per run -> results/nodes/nodes_sharded_world.*")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--links", default="1gbit,100mbit", help="tc rates between nodes")
    parser.add_argument("--configs", default=None, help=f"comma-separated, from {list(CONFIGS)} (default: all but "
                                                         "the FSDP world ones)")
    parser.add_argument("--budget", type=float, default=None, help="training seconds per run")
    parser.add_argument("--warm", type=int, default=None, help="steps before the steady-state window")
    parser.add_argument("--freeze-step", type=int, default=None, help="staged warm-up steps (keep it below --warm)")
    parser.add_argument("--max-minutes", type=float, default=30.0, help="skip the runs left after this")
    parser.add_argument("--output", default=None, help="path stem (default benchmarks/results/nodes/nodes_sharded[_quick])")
    parser.add_argument("--quiet", action="store_true", help="no live output of rank 0")
    parser.add_argument("--report-only", action="store_true", help="rewrite the .md from the existing .json")
    for key, default in MODEL_ARGS.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=type(default), default=default)
    args = parser.parse_args(argv)
    if args.project:
        from benchmarks.nodes import sharded_projection as nodes_sharded_projection

        return nodes_sharded_projection.main(Path(args.output) if args.output else None)
    name = "nodes_sharded_world" if args.world else "nodes_sharded_quick" if args.quick else "nodes_sharded"
    stem = Path(args.output) if args.output else RESULTS / "nodes" / name
    if args.report_only:
        write(json.loads(Path(f"{stem}.json").read_text()), stem, final=args.world)
        return 0
    preset = WORLD if args.world else QUICK if args.quick else FULL
    args.budget = args.budget or preset["budget"]
    args.warm = preset["warm"] if args.warm is None else args.warm
    args.freeze_step = preset["freeze_step"] if args.freeze_step is None else args.freeze_step
    default = WORLD["configs"] if args.world else [c for c in CONFIGS if not c.startswith("fsdp_")]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()] if args.configs else list(default)
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    links = [parse_link(t.strip()) for t in args.links.split(",")]
    runs = [(link, c) for link in links for c in configs]
    try:
        require_root()
    except NetemError as err:
        print(f"benchmarks.nodes.driver --sharded: {err}", file=sys.stderr)
        return 2
    stem.parent.mkdir(parents=True, exist_ok=True)
    partial = stem.with_name(stem.name + ".rank0.tmp")
    records: list[dict] = []
    data = {
        "command": " ".join(["python -m benchmarks.nodes --sharded", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": machine(),
        "settings": {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
                     "links": {link.name: " ".join(link.qdisc()) for link in links}, "configs": configs,
                     "budget_s": args.budget, "warm_steps": args.warm, "freeze_step": args.freeze_step,
                     "model": {k: getattr(args, k) for k in MODEL_ARGS}},
        "records": records,
    }
    print(f"sharded nodes benchmark: {args.nodes} nodes x {args.ranks_per_node} ranks, links "
          f"{[link.name for link in links]}, {len(runs)} runs of {args.budget:g} s: {configs}", flush=True)
    start, deadline = time.monotonic(), time.monotonic() + args.max_minutes * 60
    try:
        with Network(nodes=args.nodes, ranks_per_node=args.ranks_per_node, link=links[0]) as net:
            for i, (link, config) in enumerate(runs):
                label = f"({i + 1}/{len(runs)}) {link.name} {config}"
                if time.monotonic() + args.budget + 30 > deadline:
                    print(f"[{time.monotonic() - start:7.1f}s] {label}: skipped (--max-minutes {args.max_minutes:g})",
                          flush=True)
                    records.append({"config": config, "link": link.name, "failed": True, "skipped": True})
                    continue
                if net.link != link:
                    net.set_link(link)
                t0 = time.monotonic()
                print(f"[{t0 - start:7.1f}s] {label}: running", flush=True)
                rec = run_config(net, config, args, partial, echo=not args.quiet)
                records.append(rec)
                if not rec.get("failed"):
                    data["settings"]["params"] = rec["params"]
                what = (f"FAILED{' (timed out)' if rec.get('timed_out') else ''}" if rec.get("failed") else
                        f"{rec['steps']} steps, {rec['step_s'] * 1e3:.1f} ms/step, link "
                        f"{_mean(rec['cross_node_bytes_per_node_per_step']) / 1e3:.1f} kB/step per node (logged "
                        f"{_mean(rec['logged_bytes_per_node_per_step']) / 1e3:.1f}, cost model "
                        f"{rec['model_bytes_per_node'] / 1e3:.1f}), loss {rec['loss_reached']:.3f}, "
                        f"val {rec['val_loss']:.3f}")
                print(f"[{time.monotonic() - start:7.1f}s] {label}: {what} in {time.monotonic() - t0:.1f}s", flush=True)
                if rec.get("failed"):
                    print("\n".join(f"  rank {k}: ...{v[-600:]}" for k, v in rec["error"].items()), flush=True)
                data["settings"]["total_seconds"] = round(time.monotonic() - start, 1)
                write(data, stem)
    except NetemError as err:
        print(f"benchmarks.nodes.driver --sharded: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("benchmarks.nodes.driver --sharded: interrupted; ranks killed, namespaces removed", file=sys.stderr)
        return 130
    data["settings"]["total_seconds"] = round(time.monotonic() - start, 1)
    write(data, stem, final=True)
    print(table(records), flush=True)
    print(f"[{time.monotonic() - start:7.1f}s] wrote {stem}.json, {stem}.md, {stem}.png", flush=True)
    return 0 if not any(r.get("failed") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
