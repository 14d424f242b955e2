"""Trainer runs with every registered strategy name, each in a fresh interpreter."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import lowbit_strategy
from lowbit_strategy import LowBitConfig, LowBitStrategy
from lowbit_strategy.integrations.lightning import VARIANTS, strategy_names

ROOT = Path(__file__).resolve().parents[2]


def _fit(tmp_path, *args, timeout=240) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.lightning_app", "--out", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


ALL_NAMES = [base + suffix for base in strategy_names() for suffix in VARIANTS]


def test_every_name_is_registered_on_import():
    from lightning.pytorch.strategies import StrategyRegistry

    # the package also advertises the sharded names (tests/integrations/test_lightning_sharded.py)
    fsdp = {n for n in lowbit_strategy.STRATEGY_NAMES if n.endswith("_fsdp")}
    assert set(ALL_NAMES) <= set(StrategyRegistry) and set(ALL_NAMES) == set(lowbit_strategy.STRATEGY_NAMES) - fsdp
    strategy = StrategyRegistry.get("lowbit_lion_8bit_notebook")
    assert isinstance(strategy, LowBitStrategy)
    cfg = strategy.lowbit_config
    assert (cfg.algorithm, cfg.lion.mode, cfg.lion.bits, strategy._start_method) == ("lion", "lp", 8, "fork")
    assert StrategyRegistry.get("lowbit_bitdp_1bit_spawn").lowbit_config.bitdp.bits == 1


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_NAMES)
def test_trainer_runs_with_each_registered_name(tmp_path, name):
    devices = 3 if name.endswith("_notebook") else 2
    bitdp = name.startswith("lowbit_bitdp")
    onebit = next((o for prefix, o in (("lowbit_adam", "onebit_adam"), ("lowbit_lamb", "onebit_lamb"),
                                       ("lowbit_turboquant", "turboquant")) if name.startswith(prefix)), None)
    optimizer = "adamw" if bitdp else onebit or "lion"
    r = _fit(tmp_path, "--strategy", name, "--devices", str(devices), "--optimizer", optimizer)
    assert "error" not in r, r.get("error")
    m = r["metrics"]
    assert m["train_loss"] < r["first_loss"], "loss must fall"
    assert m["comm/bytes_per_step"] > 0
    # popen launch: this process was rank 0, so its strategy still holds the run's traffic
    suffix = next((s for s in ("_spawn", "_notebook") if name.endswith(s)), "")
    assert (r["bytes_after_fit"] > 0) == (VARIANTS[suffix] == "popen"), r["bytes_after_fit"]
    if bitdp:  # only the MLP's linear weights are quantized in this tiny model (tied head stays fp32)
        assert m["comm/ratio_vs_fp32"] > 1.2, m
        return
    if onebit == "turboquant":  # the last step compresses: 4-bit codes, replicas identical by construction
        assert m["comm/ratio_vs_fp32"] > 4, m
        assert m["divergence/max"] > 0 and m["spread/variance/max"] == 0, m
        return
    if onebit:  # the last step is in the compression stage: 1-bit momenta plus 8 bytes of scales per peer
        assert m["comm/ratio_vs_fp32"] > 10, m
        assert m["divergence/max"] > 0 and 0 < m["variance/max"] < float("inf"), m
        return
    if VARIANTS[suffix] == "popen":  # this process was rank 0: its strategy is the one that trained
        assert r["overlap"] is True, "Lion Cub starts each bucket's collective from the DDP hook by default"
        assert r["momentum_syncs"] == r["global_step"] // 5 > 0, "MomentumSync(every=5) reached the config"
    if name.startswith("lowbit_lion_fp32"):
        assert 0.9 < m["comm/ratio_vs_fp32"] <= 1.0
    elif name.startswith(("lowbit_lion_spawn", "lowbit_lion_notebook")) or name == "lowbit_lion":
        # auto on a 1.6k-parameter model: measured codec time may make the exact fp32 sum
        # (what DDP sends) the fastest plan; it is never worse than that plus momentum sync
        assert m["comm/ratio_vs_fp32"] > 0.7, m
    else:
        assert m["comm/ratio_vs_fp32"] > 3.5, m
    assert 0.0 <= m["sign/flip"] <= m["sign/match"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name, optimizer", [("lowbit_lion", "lion"), ("lowbit_bitdp", "adamw")])
def test_one_device_trains_and_sends_nothing(tmp_path, name, optimizer):
    r = _fit(tmp_path, "--strategy", name, "--devices", "1", "--optimizer", optimizer)
    assert "error" not in r, r.get("error")
    m = r["metrics"]
    assert r["world_size"] == 1 and m["train_loss"] < r["first_loss"]
    assert m["comm/bytes_per_step"] == 0 and m["comm/ratio_vs_fp32"] == 1.0


@pytest.mark.slow
def test_wrong_optimizer_is_a_clear_error(tmp_path):
    r = _fit(tmp_path, "--strategy", "lowbit_lion_spawn", "--optimizer", "adamw")
    assert "drives lowbit_strategy.Lion" in r["error"] and "torch.optim.adamw.AdamW" in r["error"]
    assert "'lowbit_lion_spawn'" in r["error"]


@pytest.mark.slow
def test_wrong_optimizer_under_1bit_adam_names_the_fix(tmp_path):
    r = _fit(tmp_path, "--strategy", "lowbit_adam_spawn", "--optimizer", "adamw")
    assert "drives lowbit_strategy.OneBitAdam" in r["error"] and "'lowbit_adam_spawn'" in r["error"]


@pytest.mark.slow
@pytest.mark.parametrize("name, optimizer", [("lowbit_adam_spawn", "onebit_adam"), ("lowbit_lamb_spawn", "onebit_lamb"),
                                             ("lowbit_turboquant_spawn", "turboquant")])
def test_1bit_resume_is_bit_exact_and_keeps_every_ranks_errors(tmp_path, name, optimizer):
    # 4 steps an epoch, freeze_step=3: the checkpoint after epoch 1 is one step into compression
    work = tmp_path / "ckpt"
    work.mkdir()
    r = _fit(tmp_path, "--strategy", name, "--optimizer", optimizer, "--resume-check", str(work), timeout=400)
    assert "error" not in r, r.get("error")
    assert r == {"bit_exact": True, "saved_world_size": 2, "saved_algorithm": optimizer, "error_buckets": 1,
                 "rank_states_differ": True, "other_world_finite": True, "is_global_zero": True}


def test_16_mixed_is_refused_with_the_fix():
    # On CPU Lightning itself turns 16-mixed into bf16-mixed; on CUDA the plugin keeps a
    # GradScaler whose per-rank found-inf decision could hang the ranks, so setup refuses.
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = LowBitStrategy()
    strategy.precision_plugin = MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(lowbit_strategy.LowBitSetupError, match="precision='bf16-mixed'"):
        strategy.setup(SimpleNamespace())


@pytest.mark.slow
@pytest.mark.parametrize("name, optimizer", [("lowbit_lion_8bit", "lion"), ("lowbit_adam", "onebit_adam"),
                                             ("lowbit_lamb", "onebit_lamb"), ("lowbit_turboquant", "turboquant")])
def test_bf16_mixed_with_accumulation_and_clipping(tmp_path, name, optimizer):
    r = _fit(tmp_path, "--strategy", name, "--optimizer", optimizer, "--precision", "bf16-mixed",
             "--accumulate", "2", "--clip", "0.5", "--epochs", "3")
    assert "error" not in r, r.get("error")
    assert r["metrics"]["train_loss"] < r["first_loss"]
    assert r["overlap"] is False, "clipping changes gradients after backward: the sync must wait for step()"
    # 64 samples / (8 x 2 ranks) = 4 batches an epoch, 2 per optimizer step: one sync per real step
    assert r["global_step"] == 6
    if optimizer != "lion":  # steps 4-6 are past freeze_step=3 / warmup_steps=3: compressed momenta
        assert r["metrics"]["comm/ratio_vs_fp32"] > (4 if optimizer == "turboquant" else 10), r["metrics"]


@pytest.mark.slow
def test_unused_parameters_on_some_ranks(tmp_path):
    r = _fit(tmp_path, "--strategy", "lowbit_lion_spawn", "--unused")
    assert "error" not in r, r.get("error")
    assert r["metrics"]["comm/bytes_per_step"] > 0


@pytest.mark.slow
def test_resume_is_bit_exact_and_keeps_every_ranks_momentum(tmp_path):
    work = tmp_path / "ckpt"
    work.mkdir()
    r = _fit(tmp_path, "--strategy", "lowbit_lion_1bit_spawn", "--resume-check", str(work), timeout=400)
    assert "error" not in r, r.get("error")
    assert r == {"bit_exact": True, "saved_world_size": 2, "saved_algorithm": "lion", "rank_states_differ": True,
                 "other_world_finite": True, "is_global_zero": True}


def test_direct_construction():
    assert LowBitStrategy(config=LowBitConfig(mode="lp", bits=8)).lowbit_config.lion.mode == "lp"
    s = LowBitStrategy(algorithm="lion", bits=4, bucket_size_mb=2)
    assert (s.lowbit_config.lion.mode, s.lowbit_config.lion.bits, s.lowbit_config.bucket_size_mb) == ("sign", 4, 2.0)
    assert LowBitStrategy(algorithm="bitdp", bits=1).lowbit_config.bitdp.bits == 1
    assert LowBitStrategy(lion={"mode": "1bit"}, find_unused_parameters=True)._ddp_kwargs == {
        "find_unused_parameters": True}
    assert LowBitStrategy(algorithm="onebit_lamb", overlap=False).lowbit_config.onebit_lamb.overlap is False
    with pytest.raises(lowbit_strategy.ConfigError,
                       match=r"LowBitConfig\.algorithm: got 'powersgd'; allowed: lion, bitdp, onebit_adam, onebit_lamb, "
                             r"turboquant"):
        LowBitStrategy(algorithm="powersgd")
    with pytest.raises(lowbit_strategy.ConfigError, match=r"LowBitConfig\.lion\.bits"):
        LowBitStrategy(mode="1bit", bits=8)


def test_a_users_ddp_comm_hook_is_refused_up_front():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    with pytest.raises(lowbit_strategy.LowBitSetupError, match=r"remove ddp_comm_hook .*strategy='ddp'"):
        LowBitStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook)


@pytest.mark.slow
def test_bitdp_resume_is_bit_exact_and_keeps_every_ranks_residuals(tmp_path):
    # 64 samples / (8 per batch x 2 ranks) = 4 steps an epoch: the checkpoint is past the warm-up
    work = tmp_path / "ckpt"
    work.mkdir()
    r = _fit(tmp_path, "--strategy", "lowbit_bitdp_spawn", "--optimizer", "adamw", "--resume-check", str(work),
             "--lowbit", "bitdp_error_feedback=true", timeout=400)
    assert "error" not in r, r.get("error")
    assert r == {"bit_exact": True, "saved_world_size": 2, "saved_algorithm": "bitdp", "saved_iters": [4, 4],
                 "residual_names": ["mlp.0.weight", "mlp.2.weight"], "rank_states_differ": True,
                 "other_world_finite": True, "is_global_zero": True}


@pytest.mark.parametrize("name, optimizer, extra", [
    ("lowbit_lion_1bit", "lion", []),
    ("lowbit_bitdp", "adamw", ["--lowbit", "bitdp_error_feedback=true"]),
])
@pytest.mark.slow
def test_checkpoint_saved_after_fit_keeps_every_ranks_state(tmp_path, name, optimizer, extra):
    # popen launch: every rank runs the script, so every rank calls trainer.save_checkpoint after
    # fit, as in a user's script. Teardown has detached the optimizers by then.
    work = tmp_path / "ckpt"
    work.mkdir()
    r = _fit(tmp_path, "--strategy", name, "--optimizer", optimizer, "--save-after-fit-check", str(work), *extra,
             timeout=400)
    assert "error" not in r, r.get("error")
    assert r["bit_exact"] is True and r["saved_world_size"] == 2 and r["rank_states_differ"] is True, r


@pytest.mark.slow
def test_core_imports_without_lightning_and_registers_names_when_it_comes():
    # a plain-DDP user pays for neither Lightning nor Accelerate; Lightning, imported later, finds the names
    code = (
        "import sys, lowbit_strategy\n"
        "from lowbit_strategy import LowBitConfig, Lion, BitDPState, bitdp_hook, attach\n"
        "import lowbit_strategy.algorithms, lowbit_strategy.integrations.ddp, lowbit_strategy.collectives\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning', 'accelerate')]\n"
        "missing = [n for n in lowbit_strategy.__all__ if not hasattr(lowbit_strategy, n)]\n"
        "assert not missing, missing\n"
        "from lightning.pytorch.strategies import StrategyRegistry\n"
        "assert set(lowbit_strategy.STRATEGY_NAMES) <= set(StrategyRegistry), 'names not registered'\n"
        "assert lowbit_strategy.LowBitStrategy.__name__ == 'LowBitStrategy'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # and in the other order: Lightning first
    code = ("import lightning.pytorch\nimport lowbit_strategy\n"
            "from lightning.pytorch.strategies import StrategyRegistry\nassert 'lowbit_bitdp_1bit' in StrategyRegistry\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
