"""LowBitTrainer with the Trainer's FSDP arguments (``fsdp="full_shard"``, ``fsdp_config`` version
2): FSDP2 inside each node, the low-bit exchange across nodes (lowbit_strategy/integrations/hf_sharded.py).

``examples/hf_trainer_finetune.py --fsdp`` under ``torchrun --nproc-per-node 4`` with
``LOWBIT_RANKS_PER_NODE=2`` (2 emulated nodes of 2 CPU processes), on the tiny local GPT-2:
Lion Cub with Trainer's defaults (clipping) saved at step 4 and resumed from there bit for bit;
TRL's SFTTrainer through the mixin on a model the script sharded itself (no FSDP arguments), with
TurboQuant-Adam and gradient accumulation, resumed bit for bit.
"""

from __future__ import annotations

import pytest

from tests.integrations.test_hf import _launch, _train_logs, tiny_model  # noqa: F401  (tiny_model: a fixture)

pytestmark = pytest.mark.slow

SHARDED = dict(LOWBIT_RANKS_PER_NODE="2")


def _assert_sharded(run: dict, steps: int) -> None:
    assert run["world_size"] == 4 and run["global_step"] == steps and run["replicas_identical"] is True, run
    assert run["local_fraction"] < 0.55, run  # each rank holds about half the model (2 ranks a node)
    logs = _train_logs(run)
    assert logs and all(h["comm/bytes_per_step"] > 0 for h in logs), logs
    assert logs[-1]["loss"] < logs[0]["loss"], logs
    assert "HSDP fp32 all-reduce of the shards" in run["stdout"]


def test_trainer_fsdp_arguments_train_sharded_and_resume_bit_for_bit(tmp_path, tiny_model):  # noqa: F811
    common = ["--fsdp", "--max-steps", "8"]
    full = _launch(tmp_path, "full", tiny_model, *common, "--save-steps", "4", "--output-dir", str(tmp_path / "full"),
                   nproc=4, **SHARDED)
    _assert_sharded(full, 8)
    # Lion Cub 1-bit across nodes against HSDP's fp32 all-reduce of the same shards; Trainer clips (step-time sync)
    assert all(20 < h["comm/ratio_vs_fp32"] <= 32.5 for h in _train_logs(full)), _train_logs(full)
    checkpoint = tmp_path / "full" / "checkpoint-4"
    files = {p.name for p in checkpoint.iterdir()}
    # the full weights as Trainer writes them, the sharded model and optimizer through DCP, no optimizer.pt
    assert {"model.safetensors", "scheduler.pt", "sharded_model_0", "lowbit_rank_states.pt"} <= files, files
    assert "optimizer.pt" not in files
    assert len(list((checkpoint / "sharded_model_0").glob("*.distcp"))) == 4
    assert len(list((checkpoint / "lowbit_rank_states" / "model_0").iterdir())) == 4  # one file per rank
    resumed = _launch(tmp_path, "resumed", tiny_model, *common, "--output-dir", str(tmp_path / "resumed"),
                      "--resume", str(checkpoint), nproc=4, **SHARDED)
    _assert_sharded(resumed, 8)
    assert resumed["params_sha256"] == full["params_sha256"]  # bit for bit
    after = {h["step"]: h["loss"] for h in _train_logs(full) if h["step"] > 4}
    assert after and {h["step"]: h["loss"] for h in _train_logs(resumed) if h["step"] > 4} == after


def test_sft_trainer_on_a_model_sharded_by_the_script_with_turboquant_accumulation_and_resume(tmp_path,
                                                                                             tiny_model):  # noqa: F811
    # no FSDP arguments: the script hands over a model it fully_shard-ed itself (--fsdp model)
    common = ["--fsdp", "model", "--trainer", "sft", "--max-steps", "8", "--grad-accum", "2",
              "--optim-args", "warmup_steps=2"]
    env = dict(LOWBIT_ALGORITHM="turboquant", LOWBIT_TURBOQUANT_FORM="allgather", **SHARDED)
    run = _launch(tmp_path, "sft", tiny_model, *common, "--save-steps", "4", "--output-dir", str(tmp_path / "out"),
                  nproc=4, **env)
    _assert_sharded(run, 8)
    assert run["trainer"][:2] == ["LowBitSFTTrainer", "LowBitTrainerMixin"] and "SFTTrainer" in run["trainer"]
    assert run["optimizer"] == "lowbit_strategy.algorithms.turboquant.optimizer.TurboQuantAdamW"
    # 4-bit codes after warmup_steps=2, exchanged once per optimizer step (not per micro-batch)
    late = [h["comm/bytes_per_step"] for h in _train_logs(run) if h["step"] > 2]
    assert len(set(late)) == 1 and _train_logs(run)[-1]["comm/ratio_vs_fp32"] > 4, _train_logs(run)
    resumed = _launch(tmp_path, "sft_resumed", tiny_model, *common, "--output-dir", str(tmp_path / "resumed"),
                      "--resume", str(tmp_path / "out" / "checkpoint-4"), nproc=4, **env)
    assert resumed["global_step"] == 8 and resumed["params_sha256"] == run["params_sha256"]  # bit for bit
