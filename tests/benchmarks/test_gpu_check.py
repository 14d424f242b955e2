"""benchmarks/gpu_check.py (``make gpu-check``) keeps working on a machine without a GPU: it
says so and exits 0, and its training part runs every algorithm on two CPU processes."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_without_a_gpu_and_its_training_part_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run make gpu-check itself")
    said = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert said.returncode == 0 and "no CUDA device" in said.stdout
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--cpu", "--steps", "8"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    for algo in ("lion", "bitdp", "onebit_adam", "onebit_lamb", "turboquant"):
        assert f"| {algo} | 2 | cpu | yes |" in run.stdout, run.stdout
