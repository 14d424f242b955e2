"""``python -m benchmarks.gpu_check [--out DIR] [--cpu] [--parts ...]`` (package docstring)."""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.gpu_check import ROOT, Part

#: part name -> module, in the order they run: the correctness parts first, so a run cut short
#: by its time limit has them (the report is rewritten after every part)
PARTS = {"kernels": "kernels", "ranks": "ranks", "codecs": "codec_speed", "time": "where_time"}
#: what ``--cpu`` runs: the parts a CPU can check (the script, not CUDA)
CPU_PARTS = ("ranks", "time")


def _environment(args) -> dict:
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
           "python": platform.python_version(), "mode": "cpu" if args.cpu else "cuda"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available() and not args.cpu:
        env["device"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = f"CPU ({platform.processor() or platform.machine()})"
    return env


def _run_part(name: str, args) -> Part:
    print(f"\n== part {name}", flush=True)
    start = time.perf_counter()
    try:
        part = importlib.import_module(f"benchmarks.gpu_check.{PARTS[name]}").run(args)
    except Exception as exc:  # a failed part is a report line, and the other parts still run
        traceback.print_exc()
        part = Part(name, name, failures=[f"{type(exc).__name__}: {exc}"])
    part.seconds = time.perf_counter() - start
    print(f"== part {name}: {'ok' if part.passed else 'FAIL'} in {part.seconds:.0f} s", flush=True)
    for line in part.failures:
        print(f"   FAIL {line}", flush=True)
    return part


def render(env: dict, parts: list[Part]) -> str:
    """``report.md``: the environment, a summary line per part, then each part's tables."""
    lines = ["# gpu-check report", "",
             f"{env['date']} · {env['device']} · torch {env['torch']} · Triton {env['triton']} · "
             f"Python {env['python']}" + (" · **--cpu: checks the script, not CUDA**" if env["mode"] == "cpu" else ""),
             "", "| part | result | seconds |", "|---|---|---:|"]
    lines += [f"| {p.title} | {'passed' if p.passed else 'FAILED: ' + '; '.join(p.failures)[:300]} | {p.seconds:.0f} |"
              for p in parts]
    for p in parts:
        lines += ["", f"## {p.title}", "", p.markdown.strip() or "(no figures)"]
    return "\n".join(lines) + "\n"


def _write(out: Path, env: dict, parts: list[Part], started: float) -> None:
    (out / "report.md").write_text(render(env, parts))
    (out / "report.json").write_text(json.dumps(
        {"environment": env, "seconds": time.perf_counter() - started,
         "parts": {p.name: {"title": p.title, "passed": p.passed, "failures": p.failures, "seconds": p.seconds,
                            "data": p.data} for p in parts}}, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="make gpu-check: what only a GPU can show (see the package docstring)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu",
                        help="folder for report.md and report.json (default: benchmarks/results/gpu)")
    parser.add_argument("--cpu", action="store_true",
                        help="run parts 3 and 4 on CPU processes over gloo, small sizes (checks the script, not CUDA)")
    parser.add_argument("--parts", default=None,
                        help=f"comma-separated subset of {','.join(PARTS)} (default: all; with --cpu: "
                             f"{','.join(CPU_PARTS)})")
    parser.add_argument("--steps", type=int, default=12, help="steps per run in part 3 (default 12)")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here, nothing to check. Without a GPU the project is verified by the CPU "
              "suite (NCCL's completion semantics emulated, Triton kernels in the interpreter), and "
              "`python -m benchmarks.gpu_check --cpu` checks this script; see the README's 'GPU status'.")
        return 0
    names = args.parts.split(",") if args.parts else list(CPU_PARTS if args.cpu else PARTS)
    unknown = [n for n in names if n not in PARTS or (args.cpu and n not in CPU_PARTS)]
    if unknown:
        parser.error(f"--parts: {unknown} not among {list(CPU_PARTS if args.cpu else PARTS)}")
    env = _environment(args)
    print(f"gpu-check on {env['device']}, torch {env['torch']}, Triton {env['triton']}: parts {', '.join(names)}",
          flush=True)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    parts: list[Part] = []
    for n in names:
        parts.append(_run_part(n, args))
        _write(args.out, env, parts, started)
    print(f"\ngpu-check summary ({time.perf_counter() - started:.0f} s; {args.out / 'report.md'}):")
    for p in parts:
        print(f"  {'ok  ' if p.passed else 'FAIL'} {p.title}" + (f": {'; '.join(p.failures)}" if p.failures else ""))
    return 0 if all(p.passed for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
