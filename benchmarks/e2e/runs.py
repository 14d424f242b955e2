"""One end-to-end training run inside the emulated network, as every GPT study launches it
(:mod:`benchmarks.e2e.driver` and :mod:`benchmarks.nodes.driver`): the model's arguments, the
calibration runs a set of configurations needs, and :func:`run_config`."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from benchmarks.e2e import report
from benchmarks.e2e.worker import CONFIGS
from benchmarks.harness.host import ROOT, cpu_busy_s, own_cpu_s
from benchmarks.harness.netem import Network

#: the worker's model and data arguments every run passes on
MODEL_ARGS = ("d_model", "layers", "heads", "seq", "batch", "val_batches", "data_mb", "seed", "log_every")


def calibrations(configs: list[str]) -> list[str]:
    """The calibration runs the DDP-hook configurations need (one per optimizer)."""
    opts = {report.CALIBRATION_OF.get(CONFIGS[c][1], CONFIGS[c][1]) for c in configs
            if CONFIGS[c][0] in ("ddp", "bf16", "fp16", "powersgd", "lowbit_bitdp", "lowbit_bitdp_1bit", "lowbit_adam",
                                 "lowbit_lamb", "lowbit_turboquant")}
    opts |= {CONFIGS[c][1] for c in configs if c.startswith("lowbit_lion")}  # codec overhead reference
    return [f"calib_{o}" for o in ("lion", "adamw") if o in opts]


def run_config(net: Network, config: str, args, partial: Path, echo: bool, env: dict | None = None) -> dict:
    """One training run of ``config`` on every rank of ``net``; its record (or a failure).
    ``env``: more variables for the ranks (e.g. ``LOWBIT_TOPOLOGY`` from :mod:`benchmarks.nodes.driver`).

    ``other_load``: the share of the machine's cores kept busy by anything but this
    benchmark's processes during the run: other users' jobs, and interrupt/softirq time
    (which includes the kernel's processing of this benchmark's own packets).
    """
    partial.unlink(missing_ok=True)
    busy0, own0, t0 = cpu_busy_s(), own_cpu_s(), time.monotonic()
    cmd = [sys.executable, "-m", "benchmarks.e2e.worker", "--config", config, "--budget", str(args.budget),
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
