"""``make gpu-check`` (``benchmarks/gpu_check``) keeps working where CI runs, without a GPU:
it says so and exits 0, and ``--cpu`` runs its parts 3 and 4 (ranks, where the time goes) on
CPU processes with the same report, so the script the GPU machine runs is itself checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check.ranks import check, compare
from benchmarks.gpu_check.ranks_worker import RUNS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_check_without_a_gpu_and_its_cpu_parts(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run make gpu-check itself")
    said = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert said.returncode == 0 and "no CUDA device" in said.stdout
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--cpu", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["parts"]) == {"ranks", "time"} and all(p["passed"] for p in report["parts"].values())
    records = report["parts"]["ranks"]["data"]["records"]
    # every algorithm through both front ends, 2 ranks flat and 2 nodes x 2, and sharded on 2 nodes x 2
    assert {(r["run"], r["front_end"], r["world_size"], r["layout"]) for r in records} == {
        (run_, front, w, lay) for run_ in RUNS for front in ("ddp", "lightning") for w, lay in ((2, "flat"), (4, "2x2"))
    } | {(run_, "sharded", 4, "2x2") for run_ in RUNS}
    for r in records:
        assert r["identical"] and r["nan_skipped"] and r["backward_reads"] == 0, r
        assert r["bytes_per_step"] > 0 and r["losses"][-1] < r["losses"][0], r
    md = (tmp_path / "report.md").read_text()
    assert "--cpu: checks the script, not CUDA" in md and "| lion_1bit | ddp | cpu | 4 | 2x2 | yes |" in md
    assert "| onebit_adam | sharded | cpu | 4 | 2x2 | yes |" in md


def _record(**kw):
    r = {"device": "cuda:0", "front_end": "ddp", "run": "lion_1bit", "layout": "flat", "world_size": 2, "nan_step": 2,
         "losses": [3.0, 2.9, 2.8, 2.5, 2.4, 2.3], "identical": True, "nan_skipped": True, "backward_reads": 0,
         "backward_syncs": 0, "where": [], "step_reads_max": 1}
    return {**r, **kw}


def test_each_check_of_a_run_can_fail():
    assert check(_record(), 6) == []
    for bad, said in ((dict(identical=False), "replicas differ"), (dict(nan_skipped=False), "not skipped"),
                      (dict(backward_syncs=2, where=["x.py:3"]), "2 CUDA syncs during backward"),
                      (dict(losses=[2.0, 2.1, 2.2, 2.5, 2.6, 2.7]), "did not fall"),
                      (dict(step_reads_max=3), "3 host reads in one optimizer.step()")):
        found = check(_record(**bad), 6)
        assert len(found) == 1 and said in found[0], found
    assert check(_record(run="bitdp", step_reads_max=3), 6) == []  # BitDP steps under torch's AdamW


def test_the_cpu_twin_comparison_measures_against_the_update(tmp_path):
    init = torch.zeros(100)
    torch.save(torch.full((100,), 1.0), tmp_path / "cpu.pt")
    torch.save(torch.full((100,), 1.1), tmp_path / "near.pt")
    torch.save(torch.full((100,), 1.8), tmp_path / "far.pt")
    cpu = {"losses": [2.0, 1.0], "params": "cpu"}
    near = compare({"losses": [2.0, 1.02], "params": "near"}, cpu, tmp_path, init)
    assert near["ok"] and abs(near["update_gap"] - 0.1) < 1e-6 and abs(near["loss_gap"] - 0.02) < 1e-6
    assert not compare({"losses": [2.0, 1.0], "params": "far"}, cpu, tmp_path, init)["ok"]
    assert not compare({"losses": [2.0, 1.2], "params": "near"}, cpu, tmp_path, init)["ok"]
