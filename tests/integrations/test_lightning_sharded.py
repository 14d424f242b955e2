"""LowBitFSDPStrategy: the registered ``lowbit_<name>_fsdp`` names, the block rule, and real
2-node x 2-device runs (one launch per node with ``NODE_RANK=K``, as test_multinode.py's
Lightning node; the checks themselves run in tests/integrations/lightning_sharded_app.py)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

import lowbit_strategy
from lowbit_strategy import LowBitSetupError

ROOT = Path(__file__).resolve().parents[2]
FSDP_NAMES = ["lowbit_lion_fsdp", "lowbit_bitdp_fsdp", "lowbit_adam_fsdp", "lowbit_lamb_fsdp", "lowbit_turboquant_fsdp",
              "lowbit_diloco_fsdp", "lowbit_demo_fsdp"]


def test_every_fsdp_name_is_registered_and_advertised():
    from lightning.pytorch.strategies import StrategyRegistry

    from lowbit_strategy.integrations.lightning_sharded import LowBitFSDPStrategy, sharded_strategy_names

    assert sorted(sharded_strategy_names()) == sorted(FSDP_NAMES)
    assert set(FSDP_NAMES) <= set(StrategyRegistry) and set(FSDP_NAMES) <= set(lowbit_strategy.STRATEGY_NAMES)
    assert lowbit_strategy.LowBitFSDPStrategy is LowBitFSDPStrategy
    expected = {"lowbit_lion_fsdp": "lion", "lowbit_bitdp_fsdp": "bitdp", "lowbit_adam_fsdp": "onebit_adam",
                "lowbit_lamb_fsdp": "onebit_lamb", "lowbit_turboquant_fsdp": "turboquant", "lowbit_diloco_fsdp": "diloco",
                "lowbit_demo_fsdp": "demo"}
    for name, algorithm in expected.items():
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, LowBitFSDPStrategy) and strategy._lowbit_name == name
        assert strategy.lowbit_config.algorithm == algorithm


def test_direct_construction():
    from lowbit_strategy.integrations.lightning_sharded import LowBitFSDPStrategy

    s = LowBitFSDPStrategy(algorithm="lion", mode="1bit", bucket_size_mb=2, save_distributed_checkpoint=False)
    assert (s.lowbit_config.lion.mode, s.lowbit_config.bucket_size_mb, s._save_distributed_checkpoint) == (
        "1bit", 2.0, False)
    assert LowBitFSDPStrategy(config={"algorithm": "onebit_adam"}).lowbit_config.algorithm == "onebit_adam"
    assert LowBitFSDPStrategy(shard_modules=[nn.Linear]).shard_modules == (nn.Linear,)
    with pytest.raises(LowBitSetupError, match="builds its own mesh"):
        LowBitFSDPStrategy(data_parallel_size=2)
    with pytest.raises(lowbit_strategy.ConfigError, match=r"LowBitConfig\.algorithm"):
        LowBitFSDPStrategy(algorithm="powersgd")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.ff = nn.LayerNorm(4), nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))


def test_repeated_blocks_are_the_outermost_repeated_modules_that_own_their_parameters():
    from lowbit_strategy.integrations.lightning_sharded import repeated_blocks

    net = nn.Module()
    net.wte = nn.Embedding(10, 4)
    net.blocks = nn.ModuleList([_Block(), _Block()])
    net.norm = nn.LayerNorm(4)
    net.head = nn.Linear(4, 10, bias=False)
    net.head.weight = net.wte.weight  # tied: stays with the root
    net.act = nn.GELU()  # no parameters
    found = repeated_blocks(net)
    assert found == [net.blocks[0], net.blocks[1], net.norm]  # not their inner Linears/LayerNorms, not the head
    assert repeated_blocks(net, (nn.Linear,)) == [net.blocks[0].ff[0], net.blocks[0].ff[1], net.blocks[1].ff[0],
                                                 net.blocks[1].ff[1]]
    assert repeated_blocks(nn.Sequential(nn.Embedding(3, 2), nn.Linear(2, 3))) == []


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, check: str, timeout: int = 420) -> list[dict]:
    """Both nodes of ``lightning_sharded_app --check check``; every rank's result."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LOWBIT_", "ACCELERATE_"))}
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()))
    cmd = [sys.executable, "-m", "tests.integrations.lightning_sharded_app", "--check", check, "--out", str(tmp_path)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env={**base, "NODE_RANK": str(node)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for node in range(2)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout))
    finally:
        for proc in procs:
            proc.kill()
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, out[-2000:] + err[-5000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
def test_lion_1bit_trains_like_plain_attach_sharded_and_resumes_bit_exact(tmp_path):
    ranks = _launch(tmp_path, "lion")
    for r in ranks:
        # auto-sharded: both Blocks and the head (Linear, repeated) are units, the wrapper root holds the embedding
        assert r["units"] == ["FSDPBlock", "FSDPLinear", "FSDP_Root"], r["units"]
        assert r["finite"] and r["identical"] and r["global_step"] == 8 and r["bytes"] > 0, r
        assert r["equals_plain"], "the same data and steps through attach_sharded give other weights"
        # the exchange starts during backward, unless gradient_clip_val edits the gradients after it
        assert r["overlap"] is True and r["overlap_when_clipping"] is False, r
        assert r["val_loss_finite"] and r["unchanged_by_validate"], r
        assert r["resume_bit_exact"], "1 epoch + checkpoint + resume != 2 epochs straight"
        assert r["self_sharded_equal"], "a module sharded in configure_model trains otherwise"
        assert r["auto"] == {"finite": True, "identical": True, "steps": 8}, r["auto"]
    assert ranks[0]["checkpoint"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp",
                                      "lowbit", "meta.pt"], ranks[0]["checkpoint"]
    assert ranks[0]["rank_files"] == [f"rank_{r:05d}_of_00004.pt" for r in range(4)]


@pytest.mark.slow
def test_1bit_adam_trains_like_plain_attach_sharded_resumes_and_syncs_once_per_step(tmp_path):
    ranks = _launch(tmp_path, "adam")
    for r in ranks:
        assert r["finite"] and r["identical"] and r["global_step"] == 8, r
        assert r["equals_plain"], "the same data and steps through attach_sharded give other weights"
        assert r["resume_bit_exact"], "1 epoch + checkpoint + resume != 2 epochs straight"
        # warm-up only: the cross-node mean runs in FSDP's hook; with accumulate_grad_batches=2 the
        # first micro-batch does not sync, so each optimizer step still exchanges once
        acc = r["accumulation"]
        # (each: [from the traffic logs, as CommStats logged it for the progress bar])
        assert acc["steps"] == [8, 4] and acc["bytes_per_step"][0][0] > 0, acc
        assert acc["bytes_per_step"][0] == acc["bytes_per_step"][1] == [acc["bytes_per_step"][0][0]] * 2, acc
        assert r["bitdp"]["finite"] and r["bitdp"]["identical"] and r["bitdp"]["bytes"] > 0, r["bitdp"]
        for name in ("lamb", "turboquant"):  # trained into their compression stage (warm-up 3 of 8 steps)
            assert r[name] == {**r[name], "finite": True, "identical": True, "steps": 8} and r[name]["bytes"] > 0, r
        assert "drives lowbit_strategy.Lion" in r["wrong_optimizer_error"], r["wrong_optimizer_error"]
        world = r["world_int4"]  # fsdp_shard="world", fsdp_reduce_scatter="int4" through the strategy's config
        assert world["mesh"] == [1, 4] and world["finite"] and world["identical"], world
        assert world["bytes"] > 0 and world["node_bytes"] > 0, world
        assert r["diloco"] == {**r["diloco"], "finite": True, "steps": 8, "rounds": 2, "equals_plain": True,
                               "resume_bit_exact": True} and r["diloco"]["bytes"] > 0, r["diloco"]
        assert r["demo"] == {**r["demo"], "finite": True, "identical": True, "steps": 8, "equals_plain": True,
                             "resume_bit_exact": True} and r["demo"]["bytes"] > 0, r["demo"]


def test_a_root_that_does_not_hold_the_model_is_refused():
    with pytest.raises(LowBitSetupError, match="root must hold model"):
        lowbit_strategy.attach_sharded(nn.Linear(2, 2), [], root=nn.Linear(2, 2))
