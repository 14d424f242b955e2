"""Model quality per algorithm on the GPT example: loss after equal steps, bytes per step.

Runs ``examples/gpt_lion.py`` once per configuration of a suite (same seed, data order
and step count; two CPU processes over loopback) and writes one JSON per run under
``benchmarks/results/quality/<suite>/`` and a markdown table ``quality_<suite>.md``.

* ``lion``: Lion Cub's modes. The paper's ordering to compare with (Table 2, Fig. 8):
  8-bit L1 ≈ 32-bit < sign votes ("4-bit") < 1-bit, 1-bit recovering with momentum sync.
* ``onebit``: AdamW under DDP fp32 against 1-bit Adam and 1-bit LAMB (warm-up for the first
  20 % of the steps). "last step" is the bytes of the final step, in the compression stage.
* ``bitdp``: AdamW under DDP fp32 and under BitDP. The paper (Table 2): fine-grained 2-bit
  costs +0.032 training loss at 350M, 1-bit more; quantizing everything ("full 2-bit") or
  the embeddings too diverges.

    python -m benchmarks.quality --suite lion [--steps 200] [--report-only]
    python -m benchmarks.quality --suite lion --steps 600 --only 32-bit,8-bit,4-bit,1-bit --tag _600
    python -m benchmarks.quality --suite lion --steps 600 --lr 5e-4 --only 32-bit,8-bit,4-bit,1-bit --tag _600_lr5e-4

``--tag`` keeps a second study (other step count) beside the default one: results go to
``quality/<suite><tag>/`` and ``quality_<suite><tag>.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    "onebit": [
        ("DDP fp32 AdamW", "ddp", ["--optimizer", "adamw"]),
        ("1-bit Adam", "lowbit_adam", ["--optimizer", "onebit_adam"]),
        ("1-bit LAMB", "lowbit_lamb", ["--optimizer", "onebit_lamb"]),
        # the same optimizer never leaving its warm-up: plain LAMB on DDP-averaged gradients,
        # the reference that separates LAMB's own loss from what compression costs
        ("LAMB uncompressed", "lowbit_lamb", ["--optimizer", "onebit_lamb", "--freeze-step", "100000000"]),
        ("Adam uncompressed", "lowbit_adam", ["--optimizer", "onebit_adam", "--freeze-step", "100000000"]),
    ],
}


def _file(suite: str, label: str, tag: str = "") -> Path:
    slug = "".join(c if c.isalnum() else "_" for c in label).strip("_").lower()
    return RESULTS / "quality" / f"{suite}{tag}" / f"{slug}.json"


def _configs(suite: str, only: str) -> list[tuple[str, str, list[str]]]:
    """The suite's configurations whose label starts with one of the comma-separated ``only``."""
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    chosen = [c for c in SUITES[suite] if not wanted or any(c[0].startswith(w) for w in wanted)]
    if not chosen:
        raise SystemExit(f"--only {only!r} matches none of: {', '.join(c[0] for c in SUITES[suite])}")
    return chosen


def run(suite: str, steps: int, devices: int, only: str = "", tag: str = "", lr: float | None = None) -> None:
    configs = _configs(suite, only)
    for i, (label, strategy, extra) in enumerate(configs, 1):
        out = _file(suite, label, tag)
        out.parent.mkdir(parents=True, exist_ok=True)
        start = time.time()
        print(f"[{i}/{len(configs)}] {label} ({strategy}) ...", flush=True)
        subprocess.run(
            [sys.executable, str(ROOT / "examples" / "gpt_lion.py"), "--strategy", strategy, "--devices", str(devices),
             "--max-steps", str(steps), "--val-every", str(max(1, steps // 2)), "--val-batches", "20",
             "--out", str(out), *extra, *(["--lr", str(lr)] if lr else [])],
            check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600,
        )
        print(f"    done in {time.time() - start:.0f} s", flush=True)


def _drift(d: dict) -> str:
    """``max |w_r − w_0|`` at the end (relative to ``max |w_0|``), where the run measured it."""
    if "replica_drift" not in d:
        return "–"
    return "0" if d["replica_drift"] == 0 else f"{d['replica_drift']:.2g} ({d['replica_drift_relative']:.1e} rel.)"


def report(suite: str, tag: str = "", devices: int = 2, lr: float | None = None) -> str:
    rows = ["| configuration | strategy | steps | val loss | train loss | KiB/step/rank | vs DDP fp32 | "
            "last step KiB | last step vs fp32 | steps/s | replica drift |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, strategy, _ in SUITES[suite]:
        path = _file(suite, label, tag)
        if not path.exists():
            continue
        d = json.loads(path.read_text())
        sent = d["bytes_per_step"]
        ratio = f"{d['fp32_bytes_per_step'] / sent:.1f}× less" if sent else "1.0× (modeled)"
        kib = sent / 1024 if sent else d["fp32_bytes_per_step"] / 1024
        loss = "diverged" if not math.isfinite(d["val_loss"]) else f"{d['val_loss']:.4f}"
        last = d.get("last_bytes_per_step")
        last_cells = (f"{last / 1024:.2f} | {d['fp32_bytes_per_step'] / last:.1f}× less" if last and
                      math.isfinite(last) else "– | –")
        rows.append(f"| {label} | `{strategy}` | {d['steps']} | {loss} | {d['train_loss']:.4f} | "
                    f"{kib:.1f} | {ratio} | {last_cells} | {d['steps_per_s']:.2f} | {_drift(d)} |")
    table = "\n".join(rows)
    command = f"python -m benchmarks.quality --suite {suite}" + (f" ... --tag {tag}" if tag else "")
    (RESULTS / f"quality_{suite}{tag}.md").write_text(
        f"# Quality: {suite}{tag}\n\n`{command}` — examples/gpt_lion.py, "
        f"1.85M parameters, {devices} CPU processes (gloo over loopback), seed 0, batch 16 x 128 bytes per rank, "
        + (f"warm-up + cosine LR peaking at {lr:g} for every configuration" if lr else
           "warm-up + cosine LR (Lion 1e-3, AdamW and 1-bit Adam/LAMB 3e-3; a configuration may set its own)")
        + ".\n\n" + table + "\n")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated label prefixes to run")
    parser.add_argument("--tag", default="", help="suffix of the results folder and table")
    parser.add_argument("--lr", type=float, default=None, help="learning rate for every configuration")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    if not args.report_only:
        run(args.suite, args.steps, args.devices, args.only, args.tag, args.lr)
    print(report(args.suite, args.tag, args.devices, args.lr))


if __name__ == "__main__":
    main()
