"""DiLoCo's outer optimizer swept with H: quality runs of the time-to-quality study's model, one
per point ``H:outer_lr:outer_momentum`` (or ``H:outer_lr:outer_momentum:F:tau`` for the streaming
form: F fragments, each exchange applied tau inner steps late), each the recorded int4 H = 50 run
(same model, data, inner lr, schedule, seed) with only those fields changed, and a table of where
each ends.

    python -m benchmarks.ttq.diloco_sweep 50:1.0:0 50:0.7:0.5 10:1.0:0 --seeds 0
    python -m benchmarks.ttq.diloco_sweep 10:0.7:0.5:2:1 --seeds 0       # Streaming DiLoCo

Why a sweep of its own: the outer optimizer multiplies each round's mean pseudo-gradient by about
``outer_lr / (1 - outer_momentum)`` once its momentum has built up (DiLoCo's 0.7 and 0.9: 7x). At
H = 500 (the paper's) a worker's drift is far from linear in H and the product is what moves the
global weights at all; at the H of a short run the drift is nearly H inner steps, so the same
product acts as a 7x larger inner learning rate. The step time does not depend on these fields
(same bytes, same compute), so the study's timing runs of the same H and compression price every
point; this script only measures quality.

Runs go to ``results/ttq/diloco/sweep/runs/<name>.json`` (kept: a point already run with the same
settings is read, not run again); the table to ``results/ttq/diloco/sweep/sweep.md``. About 12-17
minutes a run on 2 cores (4 ranks on loopback, 1,500 steps of the 4.03M-parameter GPT).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.harness import procs
from benchmarks.harness.host import RESULTS, ROOT
from benchmarks.ttq.driver import loopback_envs

BASE = RESULTS / "ttq" / "diloco" / "runs" / "quality" / "lowbit_diloco_int4_h50_lr0.00075_seed0.json"
REFERENCE = RESULTS / "ttq" / "runs" / "quality"
OUT = RESULTS / "ttq" / "diloco" / "sweep"
#: DiLoCo's paper values: the study's recorded int4 runs used them
PAPER = (0.7, 0.9)


Point = tuple[int, float, float, int, int]  # H, outer lr, outer momentum, fragments, delay


def parse_point(text: str) -> Point:
    """``"50:0.7:0.9"`` -> (50, 0.7, 0.9, 1, 0); ``"10:0.7:0.5:2:1"`` -> (10, 0.7, 0.5, 2, 1);
    refused naming the form when malformed."""
    try:
        fields = text.split(":")
        if len(fields) not in (3, 5):
            raise ValueError
        f, tau = (int(fields[3]), int(fields[4])) if len(fields) == 5 else (1, 0)
        return int(fields[0]), float(fields[1]), float(fields[2]), f, tau
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"point {text!r}: expected H:outer_lr:outer_momentum[:fragments:delay], e.g. 50:0.7:0.9 or 10:0.7:0.5:2:1")


def settings_of(base: dict, point: Point, seed: int, compression: str, inner_lr: float | None = None) -> dict:
    """The recorded base run's settings with the point's fields (and the inner lr, when given)."""
    h, lr, momentum, fragments, delay = point
    lowbit = (f"diloco_compression={compression},diloco_sync_every={h},"
              f"diloco_outer_lr={lr:g},diloco_outer_momentum={momentum:g}")
    if fragments > 1:
        lowbit += f",diloco_fragments={fragments},diloco_delay={delay}"
    return {**base, "seed": seed, "lowbit": lowbit, **({"lr": inner_lr} if inner_lr else {})}


def name_of(point: Point, seed: int, compression: str, inner_lr: float | None = None) -> str:
    h, lr, momentum, fragments, delay = point
    stream = f"_f{fragments}_d{delay}" if fragments > 1 else ""
    inner = f"_ilr{inner_lr:g}" if inner_lr else ""
    return f"{compression}_h{h}_olr{lr:g}_om{momentum:g}{stream}{inner}_seed{seed}"


def timing_name(compression: str, point: Point) -> str:
    """The study's timing run (:data:`benchmarks.ttq.driver.DILOCO`) of a point's compression, H
    and form: the outer lr and momentum change no byte and no step."""
    name = f"lowbit_diloco_{'stream_' if point[3] > 1 else ''}{compression}_h{point[0]}"
    return name + (f"_d{point[4]}" if point[3] > 1 and point[4] != 1 else "")


def run(settings: dict, path: Path) -> dict:
    """One quality run (4 ranks on loopback), or the recorded one with these settings."""
    if path.exists() and (rec := json.loads(path.read_text())).get("settings") == settings:
        print(f"  kept {path.name}", flush=True)
        return rec
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    cmd = [sys.executable, "-m", "benchmarks.ttq.worker", "--out", str(partial), "--timeout", "3000"]
    for key, value in settings.items():
        if value not in ("", None):
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    start = time.monotonic()
    done = procs.launch([cmd] * 4, loopback_envs(env), timeout=3600, cwd=str(ROOT))
    if done.timed_out or any(c != 0 for c in done.returncodes) or not partial.exists():
        raise RuntimeError(f"{path.stem}: the run failed:\n{done.outputs[0][-1500:]}")
    rec = json.loads(partial.read_text())
    rec.update(settings=settings, run_seconds=round(time.monotonic() - start, 1),
               date=time.strftime("%Y-%m-%d %H:%M:%S"))
    path.write_text(json.dumps(rec) + "\n")
    partial.unlink()
    return rec


def val_at(rec: dict, step: int) -> float:
    return next(e[2] for e in rec["evals"] if e[0] >= step)


def table(rows: list[tuple[str, tuple, int, dict]], reference: dict[int, dict]) -> str:
    """Markdown: each point's validation loss at a quarter, half and all of the run, and its final
    loss against DDP + AdamW's of the same seed (the issue's goal: within 2 %)."""
    steps = rows[0][3]["steps"]
    marks = [steps // 4, steps // 2, steps]
    out = ["| compression | H | F | τ | inner lr | outer lr | outer momentum | lr x 1/(1-m) | seed | "
           + " | ".join(f"val @ {m}" for m in marks) + " | vs DDP + AdamW |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(marks) + "---:|"]
    for compression, (h, lr, momentum, fragments, delay), seed, rec in rows:
        final = rec["evals"][-1][2]
        ref = reference.get(seed)
        gap = f"{100 * (final / ref['evals'][-1][2] - 1):+.1f} %" if ref else "–"
        out.append(f"| {compression} | {h} | {fragments} | {delay} | {rec['settings']['lr']:g} | {lr:g} | {momentum:g} | "
                   f"{lr / (1 - momentum):.2g} | {seed} | "
                   + " | ".join(f"{val_at(rec, m):.3f}" for m in marks) + f" | {gap} |")
    return "\n".join(out)


def projected(rows: list[tuple[str, tuple, int, dict]]) -> str:
    """Markdown: each point's time to the study's target on each link, projected as the study
    projects (:mod:`benchmarks.ttq.analysis`: the smoothed curve's crossing, through the step
    times of the study's timing run of the same compression and H: the outer lr and momentum
    change no byte and no step), beside DDP bf16 and the fastest per-step method of the study's
    report (seed 0). Points whose H has no timing run are left out."""
    from benchmarks.ttq import analysis as ta

    report = json.loads((RESULTS / "ttq" / "diloco" / "ttq.json").read_text())["result"]["links"]
    timing_dir = RESULTS / "ttq" / "diloco" / "runs" / "timing"
    lines = []
    for link, data in report.items():
        target = data["target"]
        per = {k: v["per_seed"]["0"]["seconds_to_target"] for k, v in data["rows"].items()
               if "per_seed" in v and not k.startswith("lowbit_diloco") and v["per_seed"].get("0", {}).get(
                   "seconds_to_target") is not None}
        bf16 = per.get("ddp_bf16_adamw")
        best_key = min((k for k in per if k.startswith("lowbit")), key=per.get, default=None)
        for compression, point, seed, rec in rows:
            h, lr, momentum, fragments, delay = point
            f = timing_dir / f"{timing_name(compression, point)}@{link}.json"
            if seed != 0 or not f.exists():
                continue
            timing = ta.phase_times(json.loads(f.read_text())["step_s"], 0)
            curve = ta.smooth([(e[0], e[2]) for e in rec["evals"]])
            step = ta.steps_to_target(curve, target)
            if step is None:
                cells = ["not reached", "–", "–"]
            else:
                sec = ta.seconds_at(ta.cumulative_seconds(rec["steps"], 0, timing), step)
                cells = [f"{sec:,.0f}", f"{bf16 / sec:.2f}×" if bf16 else "–",
                         f"{per[best_key] / sec:.2f}×" if best_key else "–"]
            lines.append(f"| {link} | {compression} | {h} | {fragments} | {delay} | {rec['settings']['lr']:g} | "
                         f"{lr:g} | {momentum:g} | "
                         f"{timing['main']['mean']:.3f} | "
                         + " | ".join(cells) + " |")
        lines.append(f"| {link} | DDP bf16 + AdamW; fastest per-step: {best_key} | | | | | | | | "
                     f"{bf16:,.0f}; {per[best_key]:,.0f} | | |" if bf16 and best_key else f"| {link} |" + " |" * 11)
    head = ("| link | compression | H | F | τ | inner lr | outer lr | outer momentum | s/step | time to target (s) | "
            "× DDP bf16 | × fastest per-step |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    return head + "\n" + "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("points", nargs="*", type=parse_point, help="H:outer_lr:outer_momentum[:fragments:delay]; "
                   "none: only the table of the recorded runs")
    p.add_argument("--seeds", default="0")
    p.add_argument("--compression", default="int4")
    p.add_argument("--inner-lr", type=float, default=None,
                   help="the inner AdamW's lr (default: the recorded runs', DDP + AdamW's best)")
    p.add_argument("--output", default=str(OUT))
    args = p.parse_args(argv)
    out = Path(args.output)
    base = json.loads(BASE.read_text())["settings"]
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for i, point in enumerate(args.points):
        for seed in seeds:
            name = name_of(point, seed, args.compression, args.inner_lr)
            print(f"[{time.strftime('%H:%M:%S')}] ({i + 1}/{len(args.points)}) {name}", flush=True)
            rec = run(settings_of(base, point, seed, args.compression, args.inner_lr), out / "runs" / f"{name}.json")
            print(f"    final val {rec['evals'][-1][2]:.4f}", flush=True)
            rows.append((args.compression, point, seed, rec))
    # every point recorded in the folder, this call's or an earlier one's, in one table
    kept = []
    # every point recorded here, and the study's own DiLoCo quality runs at the same inner lr (DiLoCo's
    # outer settings, 0.7 and 0.9, where their overrides name none)
    study = sorted(BASE.parent.glob(f"lowbit_diloco_*_lr{base['lr']:g}_seed*.json"))
    for f in sorted((out / "runs").glob("*.json")) + study:
        rec = json.loads(f.read_text())
        fields = dict(kv.split("=") for kv in rec["settings"]["lowbit"].split(","))
        point = (int(fields["diloco_sync_every"]), float(fields.get("diloco_outer_lr", PAPER[0])),
                 float(fields.get("diloco_outer_momentum", PAPER[1])), int(fields.get("diloco_fragments", 1)),
                 int(fields.get("diloco_delay", 0)))
        kept.append((fields["diloco_compression"], point, rec["settings"]["seed"], rec))
    kept.sort(key=lambda r: (r[0], r[1][0], r[1][3], r[3]["settings"]["lr"], -r[1][1], r[1][2], r[2]))
    # DDP + AdamW of every seed in the table, whichever seeds this call ran
    reference = {s: json.loads(f.read_text()) for s in sorted({r[2] for r in kept})
                 if (f := REFERENCE / f"ddp_adamw_lr{base['lr']:g}_seed{s}.json").exists()}
    command = " ".join(["python -m benchmarks.ttq.diloco_sweep", *(argv if argv is not None else sys.argv[1:])])
    text = (f"# DiLoCo's outer optimizer swept with H\n\n`{command}` (every point recorded in "
            f"`{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}/runs`), "
            f"{time.strftime('%Y-%m-%d %H:%M')} UTC.\n\n"
            f"Model, data, inner AdamW lr {base['lr']:g}, schedule and {base['steps']} steps as the "
            "time-to-quality study's DiLoCo runs (2 nodes x 2 ranks, a worker per node); DDP + AdamW's "
            "final loss of the same seed is the reference.\n\n" + table(kept, reference) + "\n\n"
            "Projected time to the study's target (its timing runs of the same compression and H; seed 0):\n\n"
            + projected(kept) + "\n")
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
