"""Model quality per algorithm on the GPT example: loss after equal steps, bytes per step.

Runs ``examples/gpt_lion.py`` once per configuration of a suite (same seed, data order
and step count; two CPU processes over loopback) and writes one JSON per run under
``benchmarks/results/quality/<suite>/`` and a markdown table ``quality/quality_<suite>.md``.

* ``lion``: Lion Cub's modes. The paper's ordering to compare with (Table 2, Fig. 8):
  8-bit L1 ≈ 32-bit < sign votes ("4-bit") < 1-bit, 1-bit recovering with momentum sync.
* ``onebit``: AdamW under DDP fp32 against 1-bit Adam and 1-bit LAMB (warm-up for the first
  20 % of the steps). "last step" is the bytes of the final step, in the compression stage.
* ``bitdp``: AdamW under DDP fp32 and under BitDP. The paper (Table 2): fine-grained 2-bit
  costs +0.032 training loss at 350M, 1-bit more; quantizing everything ("full 2-bit") or
  the embeddings too diverges.
* ``nodes``: P = 4 as 2 nodes x 2 ranks (two launches of the example, ``--num-nodes 2``,
  ``NODE_RANK`` 0 and 1, as on two machines): every algorithm's flat form against its
  hierarchical one (the node is the worker: it should equal the flat algorithm at N = 2
  workers that each see their node's mean gradient), and DDP + Lion / DDP + AdamW; seeds 0,
  1, 2 (``--seeds``), mean ± std over them.

    python -m benchmarks.quality --suite lion [--steps 200] [--report-only]
    python -m benchmarks.quality --suite lion --steps 600 --only 32-bit,8-bit,4-bit,1-bit --tag _600
    python -m benchmarks.quality --suite lion --steps 600 --lr 5e-4 --only 32-bit,8-bit,4-bit,1-bit --tag _600_lr5e-4

    python -m benchmarks.quality --suite nodes --steps 100 [--seeds 0,1,2] [--skip-existing]

``--tag`` keeps a second study (other step count) beside the default one: results go to
``quality/<suite><tag>/`` and ``quality_<suite><tag>.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
LINEAR = "blocks.*.qkv.weight,blocks.*.proj.weight,blocks.*.fc.weight,blocks.*.out.weight"
#: suite -> [(label, strategy, extra example arguments)]
SUITES = {
    "lion": [
        ("32-bit", "lowbit_lion_fp32", []),
        ("8-bit L1", "lowbit_lion_8bit", []),
        ("4-bit sign votes", "lowbit_lion_4bit", []),
        ("1-bit majority", "lowbit_lion_1bit", []),
        ("1-bit + momentum sync/10", "lowbit_lion_1bit", ["--momentum-sync", "10"]),
        ("auto", "lowbit_lion", []),
        # Sign votes zero the entries where ranks disagree: a smaller effective step. The
        # same baseline at half the learning rate tells that apart from compression.
        ("32-bit at lr 5e-4", "lowbit_lion_fp32", ["--lr", "5e-4"]),
    ],
    "bitdp": [
        ("DDP fp32", "ddp", ["--optimizer", "adamw"]),
        ("FG-2bit (default selection)", "lowbit_bitdp", ["--optimizer", "adamw"]),
        ("FG-1bit", "lowbit_bitdp_1bit", ["--optimizer", "adamw"]),
        ("2-bit + embeddings", "lowbit_bitdp", ["--optimizer", "adamw", "--lowbit",
                                                f"bitdp_quantize={LINEAR},wte.weight,wpe.weight"]),
        ("full 2-bit (everything)", "lowbit_bitdp", ["--optimizer", "adamw", "--lowbit", "bitdp_quantize=*"]),
    ],
    # 1-bit Adam / LAMB: full-precision warm-up for the first 20 % of the steps, then 1-bit
    # momenta; the goal is AdamW's loss within 1 % at >= 25x fewer bytes after the warm-up
    # TurboQuant-Adam: warm-up for the first 20 % of the steps, then 4-bit momenta; the paper
    # reports a loss gap of +0.002 at 124M. The scale EMA's decay (0, the default: each step's
    # own RMS), both variances (replica drift at the end), both forms, 4-bit activations.
    "turboquant": [
        ("DDP fp32 AdamW", "ddp", ["--optimizer", "adamw"]),
        ("TurboQuant (default: scale decay 0)", "lowbit_turboquant", ["--optimizer", "turboquant", "--scale-decay", "0"]),
        ("TurboQuant scale decay 0.9", "lowbit_turboquant", ["--optimizer", "turboquant", "--scale-decay", "0.9"]),
        ("TurboQuant scale decay 0.99", "lowbit_turboquant", ["--optimizer", "turboquant", "--scale-decay", "0.99"]),
        ("TurboQuant local v (paper), decay 0.9", "lowbit_turboquant",
         ["--optimizer", "turboquant", "--variance", "local", "--scale-decay", "0.9"]),
        ("TurboQuant two-stage, decay 0.9", "lowbit_turboquant",
         ["--optimizer", "turboquant", "--lowbit", "turboquant_form=two_stage", "--scale-decay", "0.9"]),
        ("TurboQuant + 4-bit activations", "lowbit_turboquant", ["--optimizer", "turboquant",
                                                                  "--compress-activations", "--scale-decay", "0.9"]),
        ("DDP AdamW + 4-bit activations", "ddp", ["--optimizer", "adamw", "--compress-activations"]),
    ],
    # what users would run instead of this package (benchmarks/harness/baselines.py): DDP fp32, torch's
    # bf16_compress_hook, torch's powerSGD_hook (rank 4, its default warm-up of 1000 steps: below
    # that it is the fp32 allreduce), each with Lion and with AdamW
    "baselines": [
        *[(f"DDP {name} + {opt_label}", strategy, opt)
          for opt_label, opt in (("Lion", []), ("AdamW", ["--optimizer", "adamw"]))
          for name, strategy in (("fp32", "ddp"), ("bf16", "ddp_bf16"), ("PowerSGD r4", "ddp_powersgd"))],
    ],
    "onebit": [
        ("DDP fp32 AdamW", "ddp", ["--optimizer", "adamw"]),
        ("1-bit Adam", "lowbit_adam", ["--optimizer", "onebit_adam"]),
        ("1-bit LAMB", "lowbit_lamb", ["--optimizer", "onebit_lamb"]),
        # the same optimizer never leaving its warm-up: plain LAMB on DDP-averaged gradients,
        # the reference that separates LAMB's own loss from what compression costs
        ("LAMB uncompressed", "lowbit_lamb", ["--optimizer", "onebit_lamb", "--freeze-step", "100000000"]),
        ("Adam uncompressed", "lowbit_adam", ["--optimizer", "onebit_adam", "--freeze-step", "100000000"]),
    ],
    # every algorithm's default, flat against hierarchical; 1-bit Adam/LAMB and TurboQuant warm
    # up for the first 20 % of the steps. Lion Cub's and TurboQuant's "auto" weigh the codec
    # time measured at setup against a 1 Gbit/s link: on a busy CPU they may send fp32 (DDP),
    # which says nothing about compression, so their compressed forms are named too: Lion Cub
    # 1-bit, TurboQuant's all-gather (the paper's Algorithm 1; its auto sent fp32 here)
    # After each pair, what the hierarchical form should equal: the flat algorithm with N = 2
    # workers that each see the mean gradient of 32 sequences (1 node x 2 ranks, batch 32: the
    # same 64 sequences per step, split in two other halves than the nodes').
    # (--lowbit last in extra: one --lowbit takes every override, a second would replace it)
    "nodes": [
        ("DDP + Lion", "ddp", []),
        ("DDP + AdamW", "ddp", ["--optimizer", "adamw"]),
        *[row for name, strategy, extra in [
              ("Lion Cub 1-bit", "lowbit_lion_1bit", []),
              ("Lion Cub auto (the default)", "lowbit_lion", []),
              ("BitDP FG-2bit + AdamW", "lowbit_bitdp", ["--optimizer", "adamw"]),
              ("1-bit Adam", "lowbit_adam", ["--optimizer", "onebit_adam"]),
              ("1-bit LAMB", "lowbit_lamb", ["--optimizer", "onebit_lamb"]),
              ("TurboQuant-Adam all-gather", "lowbit_turboquant",
               ["--optimizer", "turboquant", "--lowbit", "turboquant_form=allgather"]),
              # local updates: a round every 10 of the suite's steps (its default H = 100 would sync rarely)
              ("DiLoCo int4 H=10 + AdamW", "lowbit_diloco", ["--optimizer", "adamw", "--lowbit", "diloco_sync_every=10"]),
              # decoupled momentum: top-32 DCT coefficients of 64 x 64 chunks, 1-bit values (its defaults)
              ("DeMo sign", "lowbit_demo", ["--optimizer", "demo"]),
          ]
          for row in [*[(f"{name}, {form}", strategy,
                         [*extra, *([] if "--lowbit" in extra else ["--lowbit"]), f"topology={form}"])
                        for form in ("flat", "hierarchical")],
                      (f"{name} at N = 2 (1 x 2 ranks, batch 32)", strategy, [*extra, "--batch-size", "32"])]],
    ],
}
#: DDP baselines record no bytes (their hooks are torch's): bytes per step as a share of fp32's
MODELED = {"ddp": 1.0, "ddp_bf16": 0.5, "ddp_fp16": 0.5}
#: suite -> (nodes, processes per node); the others run one node of ``--devices`` processes
LAYOUT = {"nodes": (2, 2)}
#: rows run on another layout than their suite's: label suffix -> (nodes, processes per node);
#: each process of such a row stands for one node of the suite's (its bytes are a node's)
ROW_LAYOUT = {" at N = 2 (1 x 2 ranks, batch 32)": (1, 2)}
#: suite -> its seeds when ``--seeds`` is not given (one seed: the file names carry no seed)
SEEDS = {"nodes": (0, 1, 2)}
#: the DDP row each configuration's loss is compared with (nodes suite)
BASELINE = {"lowbit_lion": "DDP + Lion", "lowbit_lion_1bit": "DDP + Lion"}


def _layout(suite: str, label: str, devices: int) -> tuple[int, int]:
    """(nodes, processes per node) a configuration runs on."""
    return next((layout for end, layout in ROW_LAYOUT.items() if label.endswith(end)), LAYOUT.get(suite, (1, devices)))


def _file(suite: str, label: str, tag: str = "", seed: int | None = None) -> Path:
    slug = "".join(c if c.isalnum() else "_" for c in label).strip("_").lower()
    return RESULTS / "quality" / f"{suite}{tag}" / (f"{slug}.json" if seed is None else f"{slug}_seed{seed}.json")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(command: list[str], nodes: int, timeout: float) -> bool:
    """Run the example once per node (``NODE_RANK`` K, one rendezvous on loopback), at the
    lowest CPU priority; True when every node finished. A run over ``timeout`` seconds is
    killed (every node's process group) and counts as failed."""
    port, env = _port(), {k: v for k, v in os.environ.items() if not k.startswith("LOWBIT_")}
    procs = [subprocess.Popen(["nice", "-n", "19", *command], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True,
                              env={**env, "NODE_RANK": str(k), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
             for k in range(nodes)]
    deadline, ok = time.time() + timeout, True
    for proc in procs:
        try:
            ok &= proc.wait(timeout=max(1.0, deadline - time.time())) == 0
        except subprocess.TimeoutExpired:
            ok = False
            break
    for proc in procs:  # a failed node leaves the others waiting at a collective
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return ok


def _configs(suite: str, only: str) -> list[tuple[str, str, list[str]]]:
    """The suite's configurations whose label starts with one of the comma-separated ``only``."""
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    chosen = [c for c in SUITES[suite] if not wanted or any(c[0].startswith(w) for w in wanted)]
    if not chosen:
        raise SystemExit(f"--only {only!r} matches none of: {', '.join(c[0] for c in SUITES[suite])}")
    return chosen


def run(suite: str, steps: int, devices: int, only: str = "", tag: str = "", lr: float | None = None,
        seeds: tuple[int, ...] | None = None, skip_existing: bool = False, timeout: float = 3600) -> None:
    """Every configuration once per seed, seed by seed (an interrupted study has every
    configuration at its first seeds rather than some configurations at every seed)."""
    configs = _configs(suite, only)
    runs = [(seed, c) for seed in (seeds or (None,)) for c in configs]
    for i, (seed, (label, strategy, extra)) in enumerate(runs, 1):
        out = _file(suite, label, tag, seed)
        nodes, per_node = _layout(suite, label, devices)
        if skip_existing and out.exists():
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        start = time.time()
        print(f"[{i}/{len(runs)}] {label} ({strategy})" + ("" if seed is None else f", seed {seed}") + " ...",
              flush=True)
        val_every = steps if suite in LAYOUT else max(1, steps // 2)  # (P = 4 on two cores: no mid-run validation)
        command = [sys.executable, str(ROOT / "examples" / "gpt_lion.py"), "--strategy", strategy,
                   "--devices", str(per_node), "--max-steps", str(steps), "--val-every", str(val_every),
                   "--val-batches", "20", "--out", str(out), *extra, *(["--lr", str(lr)] if lr else []),
                   *([] if seed is None else ["--seed", str(seed)])]
        if suite not in LAYOUT:
            subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=timeout)
        elif not _launch([*command, "--num-nodes", str(nodes)], nodes, timeout):
            print(f"    FAILED after {time.time() - start:.0f} s", flush=True)
            continue
        print(f"    done in {time.time() - start:.0f} s", flush=True)


def _drift(d: dict) -> str:
    """``max |w_r − w_0|`` at the end (relative to ``max |w_0|``), where the run measured it."""
    if "replica_drift" not in d:
        return "–"
    return "0" if d["replica_drift"] == 0 else f"{d['replica_drift']:.2g} ({d['replica_drift_relative']:.1e} rel.)"


def report(suite: str, tag: str = "", devices: int = 2, lr: float | None = None,
           seeds: tuple[int, ...] | None = None) -> str:
    if suite in LAYOUT:
        return report_nodes(suite, tag, seeds or SEEDS[suite], lr)
    rows = ["| configuration | strategy | steps | val loss | train loss | KiB/step/rank | vs DDP fp32 | "
            "last step KiB | last step vs fp32 | steps/s | replica drift |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, strategy, _ in SUITES[suite]:
        path = _file(suite, label, tag)
        if not path.exists():
            continue
        d = json.loads(path.read_text())
        sent = d["bytes_per_step"] or MODELED.get(strategy, math.nan) * d["fp32_bytes_per_step"]
        ratio = (f"{d['fp32_bytes_per_step'] / sent:.1f}× less" if d["bytes_per_step"] else
                 f"{d['fp32_bytes_per_step'] / sent:.1f}× (modeled)" if math.isfinite(sent) else "not recorded")
        kib = sent / 1024
        loss = "diverged" if not math.isfinite(d["val_loss"]) else f"{d['val_loss']:.4f}"
        last = d.get("last_bytes_per_step")
        last_cells = (f"{last / 1024:.2f} | {d['fp32_bytes_per_step'] / last:.1f}× less" if last and
                      math.isfinite(last) else "– | –")
        rows.append(f"| {label} | `{strategy}` | {d['steps']} | {loss} | {d['train_loss']:.4f} | "
                    f"{kib:.1f} | {ratio} | {last_cells} | {d['steps_per_s']:.2f} | {_drift(d)} |")
    table = "\n".join(rows)
    command = f"python -m benchmarks.quality --suite {suite}" + (f" ... --tag {tag}" if tag else "")
    (RESULTS / "quality" / f"quality_{suite}{tag}.md").write_text(
        f"# Quality: {suite}{tag}\n\n`{command}` — examples/gpt_lion.py, "
        f"1.85M parameters, {devices} CPU processes (gloo over loopback), seed 0, batch 16 x 128 bytes per rank, "
        + (f"warm-up + cosine LR peaking at {lr:g} for every configuration" if lr else
           "warm-up + cosine LR (Lion 1e-3, AdamW and 1-bit Adam/LAMB 3e-3; a configuration may set its own)")
        + ".\n\n" + table + "\n")
    return table


def _mean_std(values: list[float]) -> str:
    if not values:
        return "–"
    if not all(math.isfinite(v) for v in values):
        return "diverged"
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.4f}"
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return f"{mean:.4f} ± {std:.4f}"


def _signed(values: list[float]) -> str:
    """Mean ± std of paired differences, signed."""
    text = _mean_std(values)
    return text if text in ("–", "diverged") or text.startswith("-") else "+" + text


def node_bytes(d: dict, ranks_per_node: int) -> tuple[float, float]:
    """(network, intra-node) bytes per step of one node, the mean over nodes of the sum over
    its ranks. DDP records nothing: its fp32 ring allreduce at P, modeled, every rank's share
    through its node's network card, as a flat algorithm's bytes are counted."""
    per_rank = d.get("rank_bytes_per_step") or []
    if not any(net or node for net, node in per_rank):
        return ranks_per_node * d["fp32_bytes_per_step"], 0.0
    nodes = len(per_rank) // ranks_per_node
    net = sum(r[0] for r in per_rank) / nodes
    return net, sum(r[1] for r in per_rank) / nodes


def _vs_ddp(strategy: str, ddp_bytes: float | None, sent: float) -> str:
    if strategy == "ddp":
        return "1.0× (modeled)"
    return f"{ddp_bytes / sent:.1f}× less" if ddp_bytes and sent else "–"


def report_nodes(suite: str, tag: str, seeds: tuple[int, ...], lr: float | None = None) -> str:
    """Mean ± std over seeds of the losses, the loss gap to the matching DDP row and of the
    hierarchical row to its flat one (paired by seed), bytes per step per node."""
    nodes, per_node = LAYOUT[suite]
    found = {label: {s: json.loads(_file(suite, label, tag, s).read_text()) for s in seeds
                     if _file(suite, label, tag, s).exists()} for label, _, _ in SUITES[suite]}
    rows = ["| configuration | strategy | topology (as run) | seeds | val loss | train loss | val vs DDP | "
            "val vs flat | cross-node KiB/step/node | vs DDP | last step | intra-node KiB/step/node |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    steps = sorted({d["steps"] for runs in found.values() for d in runs.values()})
    ddp_bytes = None
    for label, strategy, extra in SUITES[suite]:
        runs = found[label]
        if not runs:
            continue
        base = "DDP + AdamW" if "--optimizer" in extra else BASELINE.get(strategy, "DDP + Lion")
        flat = next((label[: -len(end)] + ", flat" for end in (", hierarchical", *ROW_LAYOUT) if label.endswith(end)),
                    None)
        vs_ddp = [d["val_loss"] - found[base][s]["val_loss"] for s, d in runs.items()
                  if strategy != "ddp" and s in found.get(base, {})]
        vs_flat = [d["val_loss"] - found[flat][s]["val_loss"] for s, d in runs.items()
                   if flat and s in found.get(flat, {})]
        # a row on another layout: each of its processes stands for a node
        ranks = per_node if _layout(suite, label, per_node) == LAYOUT[suite] else 1
        net, intra = (sum(x) / len(runs) for x in zip(*(node_bytes(d, ranks) for d in runs.values())))
        ddp_bytes = net if strategy == "ddp" else ddp_bytes
        # the last step (after any warm-up): rank 0's, times the ranks of a node
        lasts = [ranks * d["last_bytes_per_step"] for d in runs.values()
                 if strategy != "ddp" and math.isfinite(d.get("last_bytes_per_step", math.nan))]
        last = f"{sum(lasts) / len(lasts) / 1024:.1f}" if lasts else "–"
        topologies = sorted({d.get("topology", "–") for d in runs.values()})
        rows.append(
            f"| {label} | `{strategy}` | {' / '.join(topologies)} | {len(runs)} | "
            f"{_mean_std([d['val_loss'] for d in runs.values()])} | "
            f"{_mean_std([d['train_loss'] for d in runs.values()])} | {_signed(vs_ddp)} | {_signed(vs_flat)} | "
            f"{net / 1024:.1f} | {_vs_ddp(strategy, ddp_bytes, net)} | {last} | "
            f"{intra / 1024:.1f} |")
    table = "\n".join(rows)
    command = f"python -m benchmarks.quality --suite {suite} --steps {'/'.join(map(str, steps))}" + (
        f" --tag {tag}" if tag else "")
    (RESULTS / "quality" / f"quality_{suite}{tag}.md").write_text(
        f"# Quality: {suite}{tag}, {nodes} nodes x {per_node} ranks, {'/'.join(map(str, steps))} steps\n\n"
        f"`{command}` — examples/gpt_lion.py, 1.85M parameters, P = {nodes * per_node} CPU processes "
        f"(two launches with NODE_RANK 0 and 1, gloo over loopback), {'/'.join(map(str, steps))} steps, "
        f"seeds {', '.join(map(str, seeds))} (mean ± std over seeds; the gaps are paired by seed), batch 16 x 128 "
        "bytes per rank, "
        + (f"lr {lr:g}" if lr else "warm-up + cosine LR (Lion 1e-3, the others 3e-3; 1-bit Adam/LAMB and "
           "TurboQuant leave their warm-up at 20 % of the steps)")
        + ". **Cross-node bytes per node**: the bytes its ranks recorded as network traffic, summed "
        "(a flat run counts every rank's payload; DDP: its fp32 ring allreduce at P = 4, modeled, the same "
        "way), averaged over the run, warm-up included; **last step**: rank 0's last step times the 2 ranks of "
        "a node (after the warm-up); **intra-node**: the hierarchical form's node reduction and all-gather. "
        "Rows *at N = 2*: the flat algorithm on 1 node x 2 processes of 32 sequences each (the same 64 per "
        "step), each process standing for a node: what the hierarchical form should equal.\n\n"
        + table + "\n")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated label prefixes to run")
    parser.add_argument("--tag", default="", help="suffix of the results folder and table")
    parser.add_argument("--lr", type=float, default=None, help="learning rate for every configuration")
    parser.add_argument("--seeds", default="", help="comma-separated seeds (default: the suite's, else 0)")
    parser.add_argument("--skip-existing", action="store_true", help="keep the runs whose JSON exists")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip()) or SEEDS.get(args.suite)
    if not args.report_only:
        run(args.suite, args.steps, args.devices, args.only, args.tag, args.lr, seeds, args.skip_existing,
            args.timeout)
    print(report(args.suite, args.tag, args.devices, args.lr, seeds))


if __name__ == "__main__":
    main()
