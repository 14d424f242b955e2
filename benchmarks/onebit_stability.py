"""Do 1-bit Adam and 1-bit LAMB survive a short fine-tune on every layout and CPU float path?

The Accelerate example (``examples/accelerate_gpt.py``) at its full size, 60 steps, its
default lr (3e-3) and freeze (20 % of the run), on 4 processes: flat, and 2 emulated nodes x
2 hierarchical and sharded (FSDP2 inside each node); under this CPU's own kernels and under
torch's scalar ones (``ATEN_CPU_CAPABILITY=default``, and ``avx2`` where the CPU has
AVX-512); in the default form (compressed steps bounded by Adam's own, ``update_clip=auto``)
and in the papers' form (``update_clip=none``), with the guard and without it. Prints the
validation losses as a table, with each one's ratio to the flat run of the same form and float
path, and writes ``benchmarks/results/onebit_stability/{results.json,README.md}``.

    python -m benchmarks.onebit_stability            # ~80 s a run; the full table ~45 min here
    python -m benchmarks.onebit_stability --quick    # 1-bit Adam, default and papers' form, native only
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "onebit_stability"
LAYOUTS = {
    "flat": ("examples/accelerate.yaml", {"LOWBIT_TOPOLOGY": "flat"}),
    "2x2 hierarchical": ("examples/accelerate.yaml", {"LOWBIT_RANKS_PER_NODE": "2", "LOWBIT_TOPOLOGY": "hierarchical"}),
    "2x2 sharded": ("examples/accelerate_fsdp2.yaml", {"LOWBIT_RANKS_PER_NODE": "2"}),
}
#: form -> the example's arguments
FORMS = {
    "default (bounded)": [],
    "papers' form + guard": ["--update-clip", "none"],
    "papers' form, no guard": ["--update-clip", "none", "--guard", "none"],
}


def capabilities() -> list[str]:
    """This CPU's own kernels first, then the scalar ones, then AVX2 where it has AVX-512."""
    native = torch.backends.cpu.get_cpu_capability().lower()
    return ["native", "default"] + (["avx2"] if native.startswith("avx512") else [])


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(algorithm: str, layout: str, form: str, capability: str, steps: int, scratch: Path) -> dict:
    """One launch of the example; its summary (or the error that stopped it)."""
    config, env_layout = LAYOUTS[layout]
    out = scratch / f"{algorithm}-{layout}-{form}-{capability}.json".replace(" ", "_").replace("'", "")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LOWBIT_", "ACCELERATE_"))}
    env.update(LOWBIT_CONFIG="examples/lowbit.yaml", LOWBIT_ALGORITHM=algorithm, **env_layout)
    if capability != "native":
        env["ATEN_CPU_CAPABILITY"] = capability
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--num_processes", "4",
         "--main_process_port", str(_port()), "examples/accelerate_gpt.py", "--steps", str(steps),
         "--out", str(out), *FORMS[form]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )
    rec = {"algorithm": algorithm, "layout": layout, "form": form, "capability": capability,
           "seconds": round(time.monotonic() - start, 1)}
    if proc.returncode == 0 and out.exists():
        s = json.loads(out.read_text())
        return {**rec, "val_loss": s["val_loss"], "first_loss": s["first_loss"], "identical": s["replicas_identical"]}
    said = next((line for line in (proc.stdout + proc.stderr).splitlines() if "DivergenceError" in line), "")
    return {**rec, "val_loss": None, "stopped": said.split("DivergenceError: ", 1)[-1][:160] or proc.stderr[-300:]}


def table(records: list[dict]) -> str:
    flat = {(r["algorithm"], r["form"], r["capability"]): r["val_loss"] for r in records if r["layout"] == "flat"}
    lines = ["| algorithm | form | float path | layout | validation loss | x flat |", "|---|---|---|---|---:|---:|"]
    for r in records:
        ref = flat.get((r["algorithm"], r["form"], r["capability"]))
        if r["val_loss"] is None:
            loss, ratio = "stopped: " + ("guard" if "guard" in r.get("stopped", "") else "error"), "–"
        else:
            loss = f"{r['val_loss']:,.4g}" if r["val_loss"] < 1e3 else f"{r['val_loss']:,.0f}"
            ratio = f"{r['val_loss'] / ref:.3f}" if ref and r["val_loss"] == r["val_loss"] else "–"
        lines.append(f"| {r['algorithm']} | {r['form']} | {r['capability']} | {r['layout']} | {loss} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1-bit Adam, default and papers' form, native kernels")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--algorithms", default="onebit_adam,onebit_lamb")
    p.add_argument("--output", default=str(OUT))
    args = p.parse_args(argv)
    algorithms = ["onebit_adam"] if args.quick else args.algorithms.split(",")
    caps = ["native"] if args.quick else capabilities()
    forms = ["default (bounded)", "papers' form, no guard"] if args.quick else list(FORMS)
    out = Path(args.output)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    plan = [(a, f, c, lay) for a in algorithms for f in forms for c in caps for lay in LAYOUTS
            if not (f == "papers' form + guard" and a == "onebit_lamb")]
    print(f"1-bit stability: {len(plan)} runs of {args.steps} steps -> {out}", flush=True)
    records, t0 = [], time.monotonic()
    for i, (algorithm, form, cap, layout) in enumerate(plan, 1):
        rec = run(algorithm, layout, form, cap, args.steps, out / "runs")
        records.append(rec)
        got = "stopped by the guard" if rec["val_loss"] is None else f"val {rec['val_loss']:.4g}"
        print(f"[{time.monotonic() - t0:6.0f}s] ({i}/{len(plan)}) {algorithm} {form} {cap} {layout}: {got} "
              f"({rec['seconds']:.0f} s)", flush=True)
    md = table(records)
    print(md)
    (out / "results.json").write_text(json.dumps({"steps": args.steps, "cpu": torch.backends.cpu.get_cpu_capability(),
                                                  "records": records}, indent=1) + "\n")
    (out / "README.md").write_text(
        "# 1-bit Adam / LAMB on a short fine-tune\n\n"
        f"`python -m benchmarks.onebit_stability` on a CPU with {torch.backends.cpu.get_cpu_capability()}; "
        f"the Accelerate example, full size, {args.steps} steps, default lr and freeze, 4 processes. "
        "`x flat`: the validation loss over the flat run's of the same form and float path.\n\n" + md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
