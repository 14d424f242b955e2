"""Does every algorithm's default survive a short fine-tune on every layout and CPU float path?
(1-bit Adam and 1-bit LAMB also in the papers' form, the one that diverged.)

The Accelerate example (``examples/accelerate_gpt.py``) at its full size, 60 steps, its
default lr (3e-3) and freeze (20 % of the run), on 4 processes: flat, and 2 emulated nodes x
2 hierarchical and sharded (FSDP2 inside each node); under this CPU's own kernels and under
torch's scalar ones (``ATEN_CPU_CAPABILITY=default``, and ``avx2`` where the CPU has
AVX-512); in the default form (compressed steps bounded by Adam's own, ``update_clip=auto``)
and in the papers' form (``update_clip=none``), with the guard and without it. Prints the
validation losses as a table, with each one's ratio to the flat run of the same form and float
path, and writes ``benchmarks/results/quality/stability/{results.json,README.md}``.

    python -m benchmarks.quality.stability            # 1-bit Adam/LAMB: 45 runs, ~1 min each on 2 cores
    python -m benchmarks.quality.stability --quick    # 1-bit Adam, default and papers' form, native only
    python -m benchmarks.quality.stability --forms bounded --capabilities native,default
    python -m benchmarks.quality.stability --algorithms lion,bitdp,turboquant --forms bounded  # the others' defaults

Each run's record is kept in ``runs/``; a later invocation reuses the records it finds (delete
``runs/`` to measure again) and the README's table holds every record there, so a long table
can be measured in parts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness.host import RESULTS, ROOT

OUT = RESULTS / "quality" / "stability"
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
#: --forms names -> FORMS keys
FORM_NAMES = {"bounded": "default (bounded)", "paper-guard": "papers' form + guard", "paper": "papers' form, no guard"}


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
        rec.update(val_loss=s["val_loss"], first_loss=s["first_loss"], identical=s["replicas_identical"])
    else:
        said = next((line for line in (proc.stdout + proc.stderr).splitlines() if "DivergenceError: " in line), "")
        rec.update(val_loss=None, stopped=said.split("DivergenceError: ", 1)[-1][:400] or proc.stderr[-300:])
    _record_path(scratch, algorithm, layout, form, capability).write_text(json.dumps(rec) + "\n")
    return rec


def _record_path(scratch: Path, algorithm: str, layout: str, form: str, capability: str) -> Path:
    name = f"{algorithm}-{layout}-{form}-{capability}.record.json"
    return scratch / name.replace(" ", "_").replace("'", "")


def _order(r: dict) -> tuple:
    """The table's order: algorithm, form, float path, layout (as FORMS and LAYOUTS list them)."""
    caps = ["native", "default", "avx2"]
    return (r["algorithm"], list(FORMS).index(r["form"]), caps.index(r["capability"]) if r["capability"] in caps else 9,
            list(LAYOUTS).index(r["layout"]))


def table(records: list[dict]) -> str:
    flat = {(r["algorithm"], r["form"], r["capability"]): r["val_loss"] for r in records if r["layout"] == "flat"}
    lines = ["| algorithm | form | float path | layout | validation loss | x flat |", "|---|---|---|---|---:|---:|"]
    for r in records:
        ref = flat.get((r["algorithm"], r["form"], r["capability"]))
        if r["val_loss"] is None:
            found = re.search(r"compressed step (\d+) .*?‖ (\S+) times", r.get("stopped", ""))
            loss = f"stopped by the guard at step {found[1]} ({found[2]}× the warm-up's step)" if found else "failed"
            ratio = "–"
        else:
            loss = f"{r['val_loss']:,.4g}" if r["val_loss"] < 1e3 else f"{r['val_loss']:,.0f}"
            ratio = f"{r['val_loss'] / ref:.3f}" if ref and r["val_loss"] == r["val_loss"] else "–"
        form = r["form"] if r["algorithm"].startswith("onebit") else "default"  # the bound is 1-bit Adam/LAMB's
        lines.append(f"| {r['algorithm']} | {form} | {r['capability']} | {r['layout']} | {loss} | {ratio} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1-bit Adam, default and papers' form, native kernels")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--algorithms", default="onebit_adam,onebit_lamb")
    p.add_argument("--forms", default=",".join(FORM_NAMES),
                   help="comma-separated, of: " + ", ".join(f"{k} ({v})" for k, v in FORM_NAMES.items()))
    p.add_argument("--capabilities", default=None, help="comma-separated float paths (default: native, default, "
                   "and avx2 where the CPU has AVX-512)")
    p.add_argument("--output", default=str(OUT))
    args = p.parse_args(argv)
    algorithms = ["onebit_adam"] if args.quick else args.algorithms.split(",")
    caps = ["native"] if args.quick else (args.capabilities.split(",") if args.capabilities else capabilities())
    for f in args.forms.split(","):
        if f not in FORM_NAMES:
            p.error(f"--forms: {f!r} is not one of {', '.join(FORM_NAMES)}")
    forms = ["default (bounded)", "papers' form, no guard"]
    if not args.quick:
        forms = [FORM_NAMES[f] for f in args.forms.split(",")]
    out = Path(args.output)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    plan = [(a, f, c, lay) for a in algorithms for f in forms for c in caps for lay in LAYOUTS
            if not (f == "papers' form + guard" and a == "onebit_lamb")]
    print(f"stability: {len(plan)} runs of {args.steps} steps -> {out}", flush=True)
    t0 = time.monotonic()
    for i, (algorithm, form, cap, layout) in enumerate(plan, 1):
        kept = _record_path(out / "runs", algorithm, layout, form, cap)
        reused = kept.exists()
        rec = json.loads(kept.read_text()) if reused else run(algorithm, layout, form, cap, args.steps, out / "runs")
        got = "stopped by the guard" if rec["val_loss"] is None else f"val {rec['val_loss']:.4g}"
        print(f"[{time.monotonic() - t0:6.0f}s] ({i}/{len(plan)}) {algorithm} {form} {cap} {layout}: {got} "
              f"({rec['seconds']:.0f} s{', kept from an earlier run' if reused else ''})", flush=True)
        _write(out, args.steps)
    print(table(_records(out)))
    return 0


def _records(out: Path) -> list[dict]:
    return sorted((json.loads(f.read_text()) for f in (out / "runs").glob("*.record.json")), key=_order)


def _write(out: Path, steps: int) -> None:
    """results.json and README.md from every record in ``runs/`` (rewritten after each run)."""
    records = _records(out)
    cpu = torch.backends.cpu.get_cpu_capability()
    (out / "results.json").write_text(json.dumps({"steps": steps, "cpu": cpu, "records": records}, indent=1) + "\n")
    (out / "README.md").write_text(
        "# A short fine-tune on every layout and CPU float path\n\n"
        "1-bit Adam and 1-bit LAMB in their default (bounded) form and the papers' form; the other "
        "algorithms in their default form (`--algorithms lion,bitdp,turboquant --forms bounded`).\n\n"
        f"`python -m benchmarks.quality.stability` on a CPU with {cpu}; the Accelerate example, full size, "
        f"{steps} steps, default lr and freeze, 4 processes. `x flat`: the validation loss over the flat run's "
        "of the same form and float path.\n\n" + table(records) + "\n")


if __name__ == "__main__":
    sys.exit(main())
