"""Two nodes of two ranks on this machine, launched as users launch them, one launcher
invocation per node: ``torchrun --nnodes 2 --node-rank K``, a Lightning ``Trainer(num_nodes=2,
devices=2)`` started with ``NODE_RANK=K``, and ``accelerate launch --num_machines 2
--machine_rank K``. Each forms the hierarchical topology from the launcher's variables
(2 nodes x 2 ranks, node = the launcher's node rank), trains with every replica identical,
and sends bytes both across nodes and inside them (tests/integrations/multinode_app.py)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APP = ["-m", "tests.integrations.multinode_app"]

pytestmark = pytest.mark.slow


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _commands(front: str, out: Path, port: int) -> list[tuple[list[str], dict]]:
    runs = []
    for node in range(2):
        if front == "ddp":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]
            env = {}
        elif front == "lightning":
            cmd = [sys.executable]
            env = {"NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        else:
            cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "examples/accelerate.yaml",
                   "--num_machines", "2", "--machine_rank", str(node), "--num_processes", "4",
                   "--main_process_ip", "127.0.0.1", "--main_process_port", str(port)]
            env = {}
        runs.append((cmd + APP + ["--front", front, "--out", str(out)], env))
    return runs


@pytest.mark.parametrize("front", ["ddp", "lightning", "accelerate"])
def test_two_nodes_from_the_launcher(tmp_path, front):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LOWBIT_", "ACCELERATE_"))}
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen(cmd, cwd=ROOT, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for cmd, env in _commands(front, tmp_path, _port())]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=300))
    finally:
        for proc in procs:
            proc.kill()
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, out[-2000:] + err[-5000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert {r["topology"] for r in ranks} == {"hierarchical: 2 node(s) x 2 rank(s)"}, ranks
    assert [r["node"] for r in ranks] == [0, 0, 1, 1]
    assert len({r["digest"] for r in ranks}) == 1  # replicas identical
    assert all(r["network_bytes"] > 0 and r["node_bytes"] > 0 for r in ranks)
