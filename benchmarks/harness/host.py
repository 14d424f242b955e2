"""What every study shares about this checkout and this machine: the repository's paths, the
machine a figure was measured on, link names, CPU accounting (the "other load" of a run)."""

from __future__ import annotations

import os
import platform
import resource
from pathlib import Path

import torch

from benchmarks.harness.netem import Link

#: the repository root (where ``python -m benchmarks...`` runs) and the results folder
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def machine() -> dict:
    """What the numbers were measured on."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem = next((int(line.split()[1]) // 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal")), 0)
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_mib": mem, "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__}


def parse_link(text: str) -> Link:
    return Link(None if text == "unshaped" else text)


def cpu_busy_s() -> float:
    """Seconds of CPU the whole machine spent busy since boot (all cores, /proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its finished children (the ranks, once reaped)."""
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
