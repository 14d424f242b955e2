"""LowBitTrainer and LowBitTrainerMixin (lowbit_strategy.hf): the Hugging Face Trainer and TRL's
SFTTrainer driving the registered algorithms.

Multi-process checks run ``examples/hf_trainer_finetune.py`` under ``torchrun --nproc-per-node 2``
on the tiny local GPT-2 (``tests/examples/tiny_hf.py``), as the README tells users to: Lion Cub
with Trainer's defaults (clipping, so step-time synchronization, said once), gradient
accumulation, evaluation and the tensorboard logger; BitDP keeping Trainer's AdamW under bf16 and
gradient checkpointing; 1-bit Adam saved and resumed bit for bit, and resumed on 3 processes
with the algorithm's merge; SFTTrainer through the mixin with TurboQuant-Adam. Single-process
checks build the optimizer from TrainingArguments and refuse what cannot run. transformers,
datasets and TRL come from ``<venv>/hf-overlay`` (the Makefile), off every other test's path.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples.tiny_hf import OVERLAY, use_transformers, write_tiny_gpt2

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer_finetune.py"
WRAPPER = ROOT / "tests" / "examples" / "with_overlay.py"
TINY = ["--seq", "32", "--batch-size", "4", "--logging-steps", "2", "--lr", "2e-3"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_gpt2(tmp_path_factory.mktemp("tiny_gpt2"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, name: str, model: Path, *args: str, nproc: int = 2, **env: str) -> dict:
    """torchrun the example; returns its JSON summary plus the processes' stderr."""
    use_transformers()  # (skips without transformers)
    summary = tmp_path / f"{name}.json"
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("LOWBIT_", "ACCELERATE_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
               or k == "LOWBIT_EMULATE_NCCL"}  # (the test mode of the collectives: tests/conftest.py)
    environ.update(LOWBIT_CONFIG=str(ROOT / "examples" / "lowbit.yaml"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   TOKENIZERS_PARALLELISM="false", **env)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(_free_port()), str(WRAPPER), str(EXAMPLE), "--model", str(model),
               "--summary", str(summary), *TINY, *args]
    proc = subprocess.run(command, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {**json.loads(summary.read_text()), "stderr": proc.stderr, "stdout": proc.stdout}


def _train_logs(run: dict) -> list[dict]:
    return [h for h in run["log_history"] if "loss" in h]


def _assert_trained(run: dict, steps: int) -> None:
    assert run["world_size"] == 2 and run["global_step"] == steps, run
    assert run["replicas_identical"] is True
    logs = _train_logs(run)
    assert logs and logs[-1]["loss"] < logs[0]["loss"], logs
    for h in logs:  # bytes per step and ratio in every training log (so in every report_to logger)
        assert h["comm/bytes_per_step"] > 0 and h["comm/ratio_vs_fp32"] >= 1, h
    assert logs[-1]["comm/ratio_vs_fp32"] > 1  # (BitDP and the warm-ups send fp32 at first)
    assert "bytes sent per step per rank" in run["stdout"]


def test_lion_with_trainer_defaults_accumulation_eval_and_tensorboard(tmp_path, tiny_model):
    run = _launch(tmp_path, "lion", tiny_model, "--max-steps", "8", "--grad-accum", "2", "--eval-steps", "4",
                  "--report-to", "tensorboard", "--output-dir", str(tmp_path / "out"))
    _assert_trained(run, 8)
    assert run["algorithm"] == "lion" and run["trainer"][:2] == ["LowBitTrainer", "LowBitTrainerMixin"]
    assert "Trainer" in run["trainer"]
    assert run["optimizer"] == "lowbit_strategy.algorithms.lion_cub.optimizer.Lion"
    # Trainer's decay / no-decay groups: biases and LayerNorms without weight decay
    (n_decay, wd_decay), (n_plain, wd_plain) = run["param_groups"]
    assert (wd_decay, wd_plain) == (0.01, 0.0) and n_decay > 0 and n_plain > 0
    # 1 bit per parameter (plus a few flag bytes) against fp32: ~32x, in logs and in the summary
    assert 25 < run["ddp_bytes_per_step"] / run["bytes_per_step"] <= 32.5
    assert all(25 < h["comm/ratio_vs_fp32"] <= 32.5 for h in _train_logs(run))
    # max_grad_norm=1.0 (Trainer's default): synchronized at the step, said once, on the main process
    assert run["stderr"].count("synchronizes in optimizer.step(), not during backward") == 1
    assert "TrainingArguments.max_grad_norm=1.0" in run["stderr"]
    assert "comm_x=" in run["stderr"]  # the progress bar's postfix
    assert [h for h in run["log_history"] if "eval_loss" in h], "evaluation during training"
    events = b"".join(e.read_bytes() for e in (tmp_path / "out").rglob("events.out.tfevents*"))
    # the training scalars and the final evaluation in the same run's events (the last evaluation
    # runs inside train(): one after it could truncate the file, tensorboardX names it by the second)
    assert b"train/comm/bytes_per_step" in events and b"eval/loss" in events


def test_bitdp_keeps_trainers_adamw_under_bf16_and_gradient_checkpointing(tmp_path, tiny_model):
    run = _launch(tmp_path, "bitdp", tiny_model, "--max-steps", "8", "--bf16", "--gradient-checkpointing",
                  "--output-dir", str(tmp_path / "out"), LOWBIT_ALGORITHM="bitdp")
    _assert_trained(run, 8)
    assert run["algorithm"] == "bitdp" and run["optimizer"] == "torch.optim.adamw.AdamW"
    assert 2 < _train_logs(run)[-1]["comm/ratio_vs_fp32"] < 32  # 2-bit codes; embeddings stay fp32
    assert "synchronizes in optimizer.step()" not in run["stderr"]  # gradient-level: nothing to turn off


@pytest.fixture(scope="module")
def onebit_runs(tmp_path_factory, tiny_model) -> dict:
    """1-bit Adam (overlap kept: max_grad_norm=0), 8 steps saving at 4, and the same run resumed
    from checkpoint-4 on 2 processes and on 3."""
    tmp = tmp_path_factory.mktemp("onebit")
    common = ["--max-steps", "8", "--max-grad-norm", "0", "--optim-args", "freeze_step=3"]
    env = dict(LOWBIT_ALGORITHM="onebit_adam")
    full = _launch(tmp, "full", tiny_model, *common, "--save-steps", "4", "--output-dir", str(tmp / "full"), **env)
    checkpoint = tmp / "full" / "checkpoint-4"
    resumed = _launch(tmp, "resumed", tiny_model, *common, "--output-dir", str(tmp / "resumed"),
                      "--resume", str(checkpoint), **env)
    shutil.copytree(checkpoint, tmp / "three" / "checkpoint-4")
    three = _launch(tmp, "three", tiny_model, *common, "--output-dir", str(tmp / "three"), "--resume", "last",
                    nproc=3, **env)
    return {"full": full, "resumed": resumed, "three": three, "checkpoint": checkpoint}


def test_onebit_adam_checkpoint_holds_every_ranks_state_and_resumes_bit_for_bit(onebit_runs):
    full, resumed, checkpoint = onebit_runs["full"], onebit_runs["resumed"], onebit_runs["checkpoint"]
    _assert_trained(full, 8)
    assert full["optimizer"] == "lowbit_strategy.algorithms.onebit.adam.OneBitAdam"
    # compressed after freeze_step=3 (1-bit momenta, scales per block)
    assert _train_logs(full)[-1]["comm/ratio_vs_fp32"] > 8
    assert "synchronizes in optimizer.step()" not in full["stderr"]  # max_grad_norm=0 keeps the overlap
    assert (checkpoint / "lowbit_rank_states.pt").is_file()
    assert len(list((checkpoint / "lowbit_rank_states" / "model_0").iterdir())) == 2  # one file per rank
    assert resumed["global_step"] == 8 and resumed["replicas_identical"] is True
    assert resumed["params_sha256"] == full["params_sha256"]  # bit for bit
    after = {h["step"]: h["loss"] for h in _train_logs(full) if h["step"] > 4}
    # (the resumed run's history starts with the checkpoint's, up to step 4)
    assert after and {h["step"]: h["loss"] for h in _train_logs(resumed) if h["step"] > 4} == after


def test_resume_on_three_processes_merges_with_a_warning_and_keeps_training(onebit_runs):
    three = onebit_runs["three"]
    assert three["world_size"] == 3 and three["global_step"] == 8 and three["replicas_identical"] is True
    assert "checkpoint written with world size 2, resuming with 3" in three["stderr"], three["stderr"][-3000:]
    logs = _train_logs(three)
    assert logs and all(h["loss"] == h["loss"] for h in logs)
    assert logs[-1]["loss"] < _train_logs(onebit_runs["full"])[0]["loss"]  # below where training began


def test_sft_trainer_through_the_mixin_with_turboquant(tmp_path, tiny_model):
    run = _launch(tmp_path, "sft", tiny_model, "--trainer", "sft", "--max-steps", "8",
                  "--optim-args", "warmup_steps=2", "--output-dir", str(tmp_path / "out"),
                  # the codes, pinned: on this CPU at the default 1 Gbit/s, auto falls back to fp32
                  LOWBIT_ALGORITHM="turboquant", LOWBIT_TURBOQUANT_FORM="allgather")
    _assert_trained(run, 8)
    assert run["trainer"][:2] == ["LowBitSFTTrainer", "LowBitTrainerMixin"] and "SFTTrainer" in run["trainer"]
    assert run["optimizer"] == "lowbit_strategy.algorithms.turboquant.optimizer.TurboQuantAdamW"
    assert _train_logs(run)[-1]["comm/ratio_vs_fp32"] > 4  # 4-bit codes after warmup_steps=2
    assert run["stderr"].count("synchronizes in optimizer.step(), not during backward") == 1


# ---- one process: the optimizer from TrainingArguments, and what is refused --------------------
@pytest.fixture()
def hf(monkeypatch):
    """transformers importable here (removed from sys.path again afterwards, so that the
    processes later tests start do not pick it up)."""
    before = list(sys.path)
    use_transformers()
    for var in [k for k in os.environ if k.startswith("LOWBIT_") and k != "LOWBIT_EMULATE_NCCL"]:
        monkeypatch.delenv(var)
    import transformers

    from lowbit_strategy import hf as lowbit_hf

    yield transformers, lowbit_hf
    sys.path[:] = before


def _trainer(hf, tiny_model, tmp_path, lowbit, **args):
    transformers, lowbit_hf = hf
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True)
    training = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                              max_steps=args.pop("max_steps", 50), **args)
    return lowbit_hf.LowBitTrainer(model=model, args=training, lowbit=lowbit)


def test_optimizer_from_training_arguments(hf, tiny_model, tmp_path):
    trainer = _trainer(hf, tiny_model, tmp_path, {"algorithm": "lion"}, learning_rate=3e-4, adam_beta1=0.8,
                       adam_beta2=0.97, weight_decay=0.1)
    opt = trainer.create_optimizer()
    from lowbit_strategy import Lion

    assert type(opt) is Lion
    assert [(g["lr"], g["betas"], g["weight_decay"]) for g in opt.param_groups] == [
        (3e-4, (0.8, 0.97), 0.1), (3e-4, (0.8, 0.97), 0.0)]
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert all("bias" in names[id(p)] or "ln" in names[id(p)] for p in opt.param_groups[1]["params"])

    onebit = _trainer(hf, tiny_model, tmp_path, {"algorithm": "onebit_adam"}, max_steps=50, adam_epsilon=1e-6)
    opt = onebit.create_optimizer()
    assert type(opt).__name__ == "OneBitAdam" and opt.freeze_step == 10  # 20 % of the steps
    assert opt.param_groups[0]["eps"] == 1e-6
    tq = _trainer(hf, tiny_model, tmp_path, {"algorithm": "turboquant"},
                  optim_args="warmup_steps=7, variance=local, scale_decay=0.5")
    opt = tq.create_optimizer()
    assert type(opt).__name__ == "TurboQuantAdamW" and (opt.warmup_steps, opt.variance) == (7, "local")
    bitdp = _trainer(hf, tiny_model, tmp_path, {"algorithm": "bitdp"})
    assert type(bitdp.create_optimizer()).__name__ == "AdamW"  # Trainer's own


def test_what_cannot_run_is_refused_naming_the_fix(hf, tiny_model, tmp_path, monkeypatch):
    import torch

    from lowbit_strategy import LowBitSetupError

    with pytest.raises(ValueError, match=r"optim_args.*takes no \['momentum'\]"):
        _trainer(hf, tiny_model, tmp_path, {"algorithm": "onebit_lamb"}, optim_args="momentum=0.9").create_optimizer()
    with pytest.raises(ValueError, match="optim_args.*key=value"):
        _trainer(hf, tiny_model, tmp_path, {"algorithm": "lion"}, optim_args="freeze_step").create_optimizer()
    trainer = _trainer(hf, tiny_model, tmp_path, {"algorithm": "lion"})
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters())  # as optimizers=(AdamW(...), None) sets it
    with pytest.raises(LowBitSetupError, match=r"drives lowbit_strategy\.Lion.*torch\.optim\.adamw\.AdamW.*'bitdp'"):
        trainer.create_optimizer()
    # several CPU processes that would each train alone
    monkeypatch.setenv("WORLD_SIZE", "2")
    transformers, lowbit_hf = hf
    training = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=False, report_to="none")
    with pytest.raises(LowBitSetupError, match="use_cpu=True"):
        lowbit_hf.LowBitTrainer(model=trainer.model, args=training, lowbit={"algorithm": "lion"})


def test_parse_optim_args(hf):
    _, lowbit_hf = hf
    assert lowbit_hf.parse_optim_args(None) == {}
    assert lowbit_hf.parse_optim_args("freeze_step=200, variance=local,track=True,x=1e-3") == {
        "freeze_step": 200, "variance": "local", "track": True, "x": 1e-3}
    with pytest.raises(ValueError, match="optim_args"):
        lowbit_hf.parse_optim_args("=3")


def test_the_overlay_stays_off_other_tests_paths():
    assert str(OVERLAY) not in sys.path


def test_diloco_under_trainers_adamw_resumes_inside_a_round_bit_for_bit(tmp_path, tiny_model):
    # a round every 4 of 8 steps (int4 pseudo-gradients), the checkpoint at step 6: inside round 2, where
    # each worker's weights and AdamW state are its own (the rank states carry them)
    common = ["--max-steps", "8"]
    env = dict(LOWBIT_ALGORITHM="diloco", LOWBIT_DILOCO_SYNC_EVERY="4")
    full = _launch(tmp_path, "full", tiny_model, *common, "--save-steps", "6", "--output-dir", str(tmp_path / "full"),
                   **env)
    assert full["algorithm"] == "diloco" and full["optimizer"] == "torch.optim.adamw.AdamW"
    assert full["global_step"] == 8 and full["replicas_identical"] is True  # step 8 ends a round
    logs = _train_logs(full)
    assert logs[-1]["loss"] < logs[0]["loss"], logs
    assert logs[-1]["diloco/rounds"] == 2 and logs[-1]["comm/ratio_vs_fp32_avg"] > 8, logs[-1]
    resumed = _launch(tmp_path, "resumed", tiny_model, *common, "--output-dir", str(tmp_path / "resumed"),
                      "--resume", str(tmp_path / "full" / "checkpoint-6"), **env)
    assert resumed["params_sha256"] == full["params_sha256"]  # bit for bit


def test_demo_trainer_builds_demo_and_resumes_with_an_exchange_in_flight(tmp_path, tiny_model):
    # the trainer builds lowbit_strategy.DeMo from TrainingArguments (lr, weight decay groups) and
    # optim_args; delay 1: the checkpoint at step 6 holds step 6's gathered update, applied at step 7
    common = ["--max-steps", "8", "--optim-args", "compression_topk=8"]
    env = dict(LOWBIT_ALGORITHM="demo", LOWBIT_DEMO_DELAY="1")
    full = _launch(tmp_path, "full", tiny_model, *common, "--save-steps", "6", "--output-dir", str(tmp_path / "full"),
                   **env)
    assert full["algorithm"] == "demo" and full["optimizer"].endswith(".DeMo"), full["optimizer"]
    _assert_trained(full, 8)
    logs = _train_logs(full)
    assert logs[-1]["comm/ratio_vs_fp32_avg"] > 50 and 0 < logs[-1]["demo/energy_sent"] < 1, logs[-1]
    resumed = _launch(tmp_path, "resumed", tiny_model, *common, "--output-dir", str(tmp_path / "resumed"),
                      "--resume", str(tmp_path / "full" / "checkpoint-6"), **env)
    assert resumed["params_sha256"] == full["params_sha256"]  # bit for bit
