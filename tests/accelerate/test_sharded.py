"""LowBitAccelerator with an FSDP2 config: FSDP2 inside each node, the low-bit exchange across
nodes (lowbit_strategy/integrations/accelerate_sharded.py).

The slow test is the real ``accelerate launch`` with ``examples/accelerate_fsdp2.yaml``, once
per node (``--num_machines 2 --machine_rank K``, 2 processes each, on this machine's CPUs);
the checks run in tests/accelerate/sharded_app.py. The fast ones check what is decided before
any process group exists.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

pytest.importorskip("accelerate")
from accelerate.utils import FullyShardedDataParallelPlugin  # noqa: E402

from lowbit_strategy import LowBitSetupError  # noqa: E402
from lowbit_strategy.integrations import accelerate_sharded as sharded  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_nodes(*script: str, **env_vars: str) -> None:
    """``accelerate launch`` of ``script`` with the FSDP2 config, once per node (2 nodes of 2 processes)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LOWBIT_", "ACCELERATE_", "FSDP_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
           or k in ("LOWBIT_EMULATE_NCCL", "LOWBIT_LINK_ASSUME")}  # (the suite's test settings: tests/conftest.py)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), LOWBIT_CONFIG=str(ROOT / "examples" / "lowbit.yaml"),
               **env_vars)
    port = str(_port())
    procs = [subprocess.Popen(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "examples/accelerate_fsdp2.yaml",
         "--num_machines", "2", "--machine_rank", str(node), "--num_processes", "4",
         "--main_process_ip", "127.0.0.1", "--main_process_port", port, *script],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in range(2)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240))
    finally:
        for proc in procs:
            proc.kill()
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, out[-2000:] + err[-5000:]


@pytest.mark.slow
def test_two_nodes_of_two_train_like_attach_sharded_and_resume_bit_exact(tmp_path):
    _launch_nodes("tests/accelerate/sharded_app.py", "--out", str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in ranks:
        # Accelerate runs the plain multi-process path on CPU; the accelerator sharded the model itself
        assert r["distributed_type"] == "MULTI_CPU" and r["units"] == ["FSDPBlock", "FSDPGPT"], r
        assert r["local_fraction"] == 0.5 and r["optimizer_holds_shards"], r  # 1/L of the model on each rank
        assert r["finite"] and r["identical"], r
        assert r["state_dict_full"], "get_state_dict of a sharded model is not its full weights"
        assert r["equals_plain"], "the same data and steps through attach_sharded give other weights"
        assert r["resume_bit_exact"], "3 steps + save_state + load_state + 3 steps != 6 steps straight"
        assert r["presharded_equal"], "a model sharded by the script (no FSDP plugin) trains otherwise"
        world = r["world"]  # LowBitConfig(fsdp_shard="world", fsdp_reduce_scatter="int8"): one FSDP group
        assert world["finite"] and world["identical"] and world["local_fraction"] == 0.25 and world["bytes"] > 0, r
        # Lion Cub 1-bit across nodes against HSDP's fp32 all-reduce of the same shards
        assert 20 < r["hsdp_bytes_per_step"] / r["bytes_per_step"] <= 32.5, r
    assert "sharded_model_0" in ranks[0]["checkpoint"] and "lowbit_rank_states.pt" in ranks[0]["checkpoint"]
    assert not any(name.startswith(("model", "optimizer")) for name in ranks[0]["checkpoint"]), ranks[0]
    assert ranks[0]["rank_files"] == [f"rank_{r:05d}_of_00004.pt" for r in range(4)]


@pytest.mark.slow
def test_the_accelerate_example_trains_sharded_with_the_fsdp2_config(tmp_path):
    # examples/accelerate_gpt.py unchanged but for the config file: the README's command
    out, ckpt = tmp_path / "summary.json", tmp_path / "ckpt"
    _launch_nodes("examples/accelerate_gpt.py", "--steps", "4", "--d-model", "32", "--layers", "2", "--seq", "32",
                  "--batch-size", "4", "--data-mb", "0.2", "--val-batches", "2", "--accumulate", "2",
                  "--save", str(ckpt), "--out", str(out))
    r = json.loads(out.read_text())
    assert (r["world_size"], r["distributed_type"], r["sharded"], r["steps"]) == (4, "MULTI_CPU", True, 4), r
    assert r["replicas_identical"] is True and r["val_loss"] == r["val_loss"]
    assert 20 < r["ddp_bytes_per_step"] / r["bytes_per_step"] <= 32.5, r  # Lion Cub 1-bit vs HSDP fp32
    assert (ckpt / "sharded_model_0").is_dir() and (ckpt / "lowbit_rank_states.pt").is_file()


@pytest.fixture()
def clean_env(monkeypatch):
    for var in [k for k in os.environ if k.startswith(("ACCELERATE_", "FSDP_"))]:
        monkeypatch.delenv(var)
    return monkeypatch


def test_the_fsdp2_plugin_comes_from_the_argument_or_the_launchers_environment(clean_env):
    kwargs = {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2), "cpu": True}
    plugin = sharded.take_fsdp_plugin(kwargs, "who")
    assert plugin.fsdp_version == 2 and kwargs == {"cpu": True}  # taken: Accelerate never sees it
    assert sharded.take_fsdp_plugin({}, "who") is None
    clean_env.setenv("ACCELERATE_USE_FSDP", "true")  # what accelerate launch exports from an FSDP config
    clean_env.setenv("FSDP_VERSION", "2")
    clean_env.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    clean_env.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "Linear")
    plugin = sharded.take_fsdp_plugin({}, "who")
    assert plugin.fsdp_version == 2 and plugin.transformer_cls_names_to_wrap == ["Linear"]
    with sharded.fsdp_env_off():
        assert os.environ["ACCELERATE_USE_FSDP"] == "false"
    assert os.environ["ACCELERATE_USE_FSDP"] == "true"


def test_fsdp1_and_unknown_block_classes_are_refused_naming_the_fix(clean_env):
    with pytest.raises(LowBitSetupError, match=r"fsdp_version=1.*fsdp_version: 2"):
        sharded.take_fsdp_plugin({"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=1)}, "who")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["Blok"])
    with pytest.raises(LowBitSetupError, match=r"transformer_cls_names_to_wrap=\['Blok'\].*Linear"):
        sharded.wrap_classes(plugin, nn.Sequential(nn.Linear(2, 2)))
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    model._no_split_modules = ["Linear"]  # what a transformers model declares
    assert sharded.wrap_classes(FullyShardedDataParallelPlugin(fsdp_version=2), model) == {nn.Linear}
