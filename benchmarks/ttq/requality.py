"""Re-run chosen quality runs of the time-to-quality study with today's code, each with the
settings it recorded (same configuration, lr, seed, model, steps), and print the old and the new
final validation loss: whether a change to an algorithm's default moves the study's figures.

    python -m benchmarks.ttq.requality lowbit_adam_lr0.00075_seed0 lowbit_lamb_lr0.006_seed0

Each new run goes to ``results/ttq/runs/quality_rerun/<name>.json`` (the study's own runs are
left as they are: its tables keep reading those). About 17 minutes a run on 2 cores (4 ranks on
loopback, 1,500 steps of the 4.03M-parameter GPT).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks.harness import procs
from benchmarks.harness.host import RESULTS, ROOT
from benchmarks.ttq.driver import loopback_envs

RUNS = RESULTS / "ttq" / "runs" / "quality"
OUT = RESULTS / "ttq" / "runs" / "quality_rerun"


def rerun(name: str) -> tuple[float, float, float]:
    """``(old final loss, new final loss, seconds)`` of the recorded quality run ``name``."""
    old = json.loads((RUNS / f"{name}.json").read_text())
    OUT.mkdir(parents=True, exist_ok=True)
    partial = OUT / f"{name}.tmp"
    cmd = [sys.executable, "-m", "benchmarks.ttq.worker", "--out", str(partial), "--timeout", "3000"]
    for key, value in old["settings"].items():
        if value not in ("", None):
            cmd += [f"--{key.replace('_', '-')}", str(value)]
    env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    start = time.monotonic()
    procs.launch([cmd] * 4, loopback_envs(env), timeout=3600, cwd=str(ROOT))
    new = json.loads(partial.read_text())
    (OUT / f"{name}.json").write_text(json.dumps(new) + "\n")
    partial.unlink()
    return old["evals"][-1][2], new["evals"][-1][2], time.monotonic() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="+", help="recorded quality runs (file names in results/ttq/runs/quality/)")
    args = p.parse_args(argv)
    print("| run | recorded final loss | today's | change |\n|---|---:|---:|---:|")
    for name in args.names:
        old, new, seconds = rerun(name)
        print(f"| {name} | {old:.5f} | {new:.5f} | {100 * (new - old) / old:+.2f} % |  ({seconds:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
