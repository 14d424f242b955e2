"""examples/accelerate_gpt.py through the real ``accelerate launch`` with the shipped configs.

This is the command the README gives, with a tiny model and step budget: two processes from
``examples/accelerate.yaml`` (a MULTI_GPU config) on a machine without GPUs, the algorithm
from ``LOWBIT_CONFIG=examples/lowbit.yaml``. It checks that the launched processes formed one
gloo group (not two lone processes), that bytes went on the wire at Lion Cub's 1-bit rate,
that the replicas stayed identical, and that a ``LOWBIT_<FIELD>`` override reaches the run.
"""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--steps", "4", "--d-model", "32", "--layers", "1", "--seq", "32", "--batch-size", "4",
        "--data-mb", "0.2", "--val-batches", "2"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, *args, **env) -> dict:
    out = tmp_path / "summary.json"
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("LOWBIT_", "ACCELERATE_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
               or k == "LOWBIT_EMULATE_NCCL"}  # (the test mode of the collectives: tests/conftest.py)
    environ.update(LOWBIT_CONFIG="examples/lowbit.yaml", **env)
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "examples/accelerate.yaml",
         "--main_process_port", str(_free_port()), "examples/accelerate_gpt.py", *TINY, "--out", str(out), *args],
        cwd=ROOT, env=environ, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert out.exists(), proc.stderr[-4000:]
    return {**json.loads(out.read_text()), "stdout": proc.stdout}


@pytest.mark.slow
def test_readme_command_trains_on_two_cpu_processes_and_sends_32x_less(tmp_path):
    r = _launch(tmp_path)
    assert (r["world_size"], r["distributed_type"]) == (2, "MULTI_CPU")
    assert (r["algorithm"], r["section"]["mode"], r["optimizer"], r["steps"]) == ("lion", "1bit", "lion", 4)
    assert r["replicas_identical"] is True
    # 1 bit per parameter (+ a few bytes of non-finite flags) against DDP's 32-bit allreduce
    assert 25 < r["ddp_bytes_per_step"] / r["bytes_per_step"] <= 32.5, r
    assert r["val_loss"] < r["first_loss"] + 0.5 and r["val_loss"] == r["val_loss"]
    assert "bytes sent per step" in r["stdout"] and "x less" in r["stdout"]


@pytest.mark.slow
def test_environment_override_bitdp_with_adamw_bf16_accumulation_clipping_and_resume(tmp_path):
    ckpt = tmp_path / "ckpt"
    r = _launch(tmp_path, "--accumulate", "2", "--clip", "1.0", "--mixed-precision", "bf16", "--save", str(ckpt),
                LOWBIT_ALGORITHM="bitdp", LOWBIT_BITDP_BITS="2")
    assert (r["algorithm"], r["section"]["bits"], r["optimizer"], r["mixed_precision"]) == ("bitdp", 2, "adamw", "bf16")
    assert r["world_size"] == 2 and r["replicas_identical"] is True and 0 < r["bytes_per_step"] < r["ddp_bytes_per_step"]
    assert (ckpt / "lowbit_rank_states.pt").exists() and (ckpt / "optimizer.bin").exists()
    resumed = _launch(tmp_path, "--accumulate", "2", "--clip", "1.0", "--mixed-precision", "bf16",
                      "--resume", str(ckpt), LOWBIT_ALGORITHM="bitdp", LOWBIT_BITDP_BITS="2")
    assert resumed["replicas_identical"] is True and resumed["steps"] == 4
