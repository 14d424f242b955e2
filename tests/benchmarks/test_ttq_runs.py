"""benchmarks/ttq/driver.py end to end on a tiny GPT (slow tier; the links need root): the DDP
baselines' hooks really run, seen in the bytes that cross the emulated nodes' link (DDP with
torch's bf16_compress_hook sends half of fp32's; PowerSGD sends fp32's during its warm-up and
far less after it), and every stage writes its JSON, the report and the plot; Lion Cub's auto plan is recorded."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from benchmarks.ttq import driver as ttq

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
        reason="the emulated network needs root and iproute2 (`ip`, `tc`); CI runs as root",
    ),
]


def test_baseline_hooks_bytes_and_every_stage(tmp_path):
    argv = ["--configs", "ddp_adamw,ddp_bf16_adamw,ddp_powersgd_adamw,lowbit_lion", "--links", "1gbit", "--steps", "12",
            "--seeds", "0", "--lr-factors", "1", "--sweep", "", "--validate", "ddp_bf16_adamw@1gbit",
            "--powersgd-start", "6", "--model", "d_model=64,layers=1,data_mb=0.5", "--output", str(tmp_path),
            "--quiet", "--max-minutes", "8"]
    assert ttq.main(argv) == 0
    result = json.loads((tmp_path / "ttq.json").read_text())["result"]
    rows = result["links"]["1gbit"]["rows"]
    fp32 = rows["ddp_adamw"]["wire_bytes_per_step"]["main"]
    bf16 = rows["ddp_bf16_adamw"]["wire_bytes_per_step"]["main"]
    psgd = rows["ddp_powersgd_adamw"]["wire_bytes_per_step"]
    assert 0.4 < bf16 / fp32 < 0.6, (bf16, fp32)
    assert 0.8 < psgd["warm-up"] / fp32 < 1.2, (psgd, fp32)  # torch's fp32 allreduce until start_powerSGD_iter
    assert psgd["main"] / fp32 < 0.5, (psgd, fp32)
    timing = json.loads((tmp_path / "runs" / "timing" / "ddp_powersgd_adamw@1gbit.json").read_text())
    assert timing["hook_calls"] >= timing["steps"]  # the hook ran, once per bucket and step at least
    # Lion Cub's auto plan is recorded, by the timing run and by the quality run planned for its link
    lion_timing = json.loads((tmp_path / "runs" / "timing" / "lowbit_lion@1gbit.json").read_text())
    assert len(lion_timing["plan"]) == 1 and lion_timing["plan"][0].startswith("Plan(mode="), lion_timing["plan"]
    (lion_quality,) = (tmp_path / "runs" / "quality").glob("lowbit_lion@1gbit_*.json")
    (quality_plan,) = json.loads(lion_quality.read_text())["plan"]
    assert quality_plan.startswith("Plan(mode="), quality_plan
    assert result["validation"] and result["validation"][0]["measured_seconds"] > 0
    assert (tmp_path / "ttq.md").exists() and (tmp_path / "ttq_loss.png").exists()
    # --skip-existing: nothing left to run, the same report
    before = sorted(p.stat().st_mtime for p in (tmp_path / "runs").rglob("*.json"))
    assert ttq.main([*argv, "--skip-existing"]) == 0
    assert sorted(p.stat().st_mtime for p in (tmp_path / "runs").rglob("*.json")) == before
