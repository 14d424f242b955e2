"""Trainer runs with every registered strategy name.

Each run is ``tests.lightning_app`` in a fresh interpreter; runs that share a launcher share
one interpreter (a plan, :func:`tests.lightning_app.main`): the ``popen`` names one launched
process group for all their fits (as a user's script that calls ``fit`` more than once), the
``spawn`` and ``notebook`` names one parent that starts each fit's processes. Multi-fit checks
(resume, other world size) run under the fork-based ``notebook`` launcher, whose processes
start without importing anything again; the ``spawn`` launcher has its own run per name."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import lowbit_strategy
from lowbit_strategy import LowBitConfig, LowBitStrategy
from lowbit_strategy.integrations.lightning import VARIANTS, strategy_names

ROOT = Path(__file__).resolve().parents[2]


def _launch(out: Path, args: list[str], timeout: int) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.lightning_app", "--out", str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text())


def _plan(tmp: Path, runs: dict[str, list[str]], timeout: int = 600) -> dict[str, dict]:
    """``{id: result}`` of ``runs`` (``{id: arguments}``), run one after another in one interpreter."""
    plan = tmp / "plan.json"
    plan.write_text(json.dumps([[key, args] for key, args in runs.items()]))
    return _launch(tmp / "results.json", ["--plan", str(plan)], timeout)


ALL_NAMES = [base + suffix for base in strategy_names() for suffix in VARIANTS]
#: the spawn launcher trains once per algorithm (each spawned fit starts two interpreters, ~5 s):
#: the other spawn names differ from these only in the config their popen and fork twins train
#: with, which test_spawn_names_are_their_twins_config_under_spawn checks
SPAWN_TRAINED = {"lowbit_lion_1bit_spawn", "lowbit_bitdp_spawn", "lowbit_adam_spawn", "lowbit_lamb_spawn",
                 "lowbit_turboquant_spawn", "lowbit_diloco_spawn", "lowbit_demo_spawn"}
#: DiLoCo's rounds in these short fits (8 optimizer steps on 2 ranks): one every 3 steps
DILOCO = ["--lowbit", "diloco_sync_every=3"]
TRAINED = [n for n in ALL_NAMES if not n.endswith("_spawn") or n in SPAWN_TRAINED]


def _optimizer_of(name: str) -> str:
    if name.startswith(("lowbit_bitdp", "lowbit_diloco")):  # any optimizer; DiLoCo's inner one is a plain one
        return "adamw"
    return next((o for prefix, o in (("lowbit_adam", "onebit_adam"), ("lowbit_lamb", "onebit_lamb"),
                                     ("lowbit_turboquant", "turboquant"), ("lowbit_demo", "demo"))
                 if name.startswith(prefix)), "lion")


def _run_args(name: str) -> list[str]:
    devices = 3 if name.endswith("_notebook") else 2
    extra = DILOCO if name.startswith("lowbit_diloco") else []
    return ["--strategy", name, "--devices", str(devices), "--optimizer", _optimizer_of(name), *extra]


BF16 = [("lowbit_lion_8bit", "lion"), ("lowbit_adam", "onebit_adam"), ("lowbit_lamb", "onebit_lamb"),
        ("lowbit_turboquant", "turboquant")]
SAVED_AFTER_FIT = [("lowbit_lion_1bit", "lion", []), ("lowbit_bitdp", "adamw", ["--lowbit", "bitdp_error_feedback=true"])]
RESUMED = [("lowbit_adam_notebook", "onebit_adam"), ("lowbit_lamb_notebook", "onebit_lamb"),
           ("lowbit_turboquant_notebook", "turboquant")]


@pytest.fixture(scope="module")
def popen_runs(tmp_path_factory) -> dict[str, dict]:
    """Every ``popen`` run of this module, in one launched group of 2 processes."""
    tmp = tmp_path_factory.mktemp("popen")
    runs = {name: _run_args(name) for name in ALL_NAMES if VARIANTS[_suffix(name)] == "popen"}
    for name, optimizer in BF16:
        runs[f"bf16:{name}"] = ["--strategy", name, "--optimizer", optimizer, "--precision", "bf16-mixed",
                                "--accumulate", "2", "--clip", "0.5", "--epochs", "3"]
    for name, optimizer, extra in SAVED_AFTER_FIT:
        work = tmp / f"saved-{name}"
        work.mkdir()
        runs[f"saved:{name}"] = ["--strategy", name, "--optimizer", optimizer, "--save-after-fit-check", str(work),
                                 *extra]
    return _plan(tmp, runs)


@pytest.fixture(scope="module")
def spawn_runs(tmp_path_factory) -> dict[str, dict]:
    """Every ``spawn`` run of this module, from one parent interpreter."""
    runs = {name: _run_args(name) for name in SPAWN_TRAINED}
    runs["wrong:lion"] = ["--strategy", "lowbit_lion_spawn", "--optimizer", "adamw"]
    runs["wrong:adam"] = ["--strategy", "lowbit_adam_spawn", "--optimizer", "adamw"]
    runs["unused"] = ["--strategy", "lowbit_lion_spawn", "--unused"]
    return _plan(tmp_path_factory.mktemp("spawn"), runs)


@pytest.fixture(scope="module")
def fork_runs(tmp_path_factory) -> dict[str, dict]:
    """Every ``notebook`` (fork) run of this module, from one parent interpreter: a fit per
    name, and the resume checks (4 fits each: straight, 1 epoch + checkpoint, resumed, and on
    3 ranks)."""
    tmp = tmp_path_factory.mktemp("fork")
    runs = {name: _run_args(name) for name in ALL_NAMES if name.endswith("_notebook")}
    checks = [("lowbit_lion_1bit_notebook", "lion", []), *((n, o, []) for n, o in RESUMED),
              ("lowbit_bitdp_notebook", "adamw", ["--lowbit", "bitdp_error_feedback=true"]),
              ("lowbit_diloco_notebook", "adamw", DILOCO),
              ("lowbit_demo_notebook", "demo", ["--lowbit", "demo_delay=1"])]
    for name, optimizer, extra in checks:
        work = tmp / f"resume-{name}"
        work.mkdir()
        runs[f"resume:{name}"] = ["--strategy", name, "--optimizer", optimizer, "--resume-check", str(work), *extra]
    return _plan(tmp, runs)


def _suffix(name: str) -> str:
    return next((s for s in ("_spawn", "_notebook") if name.endswith(s)), "")


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


def test_spawn_names_are_their_twins_config_under_spawn():
    from lightning.pytorch.strategies import StrategyRegistry

    assert SPAWN_TRAINED <= set(ALL_NAMES) and {_optimizer_of(n) for n in SPAWN_TRAINED} == {
        "lion", "adamw", "onebit_adam", "onebit_lamb", "turboquant", "demo"}
    for name in ALL_NAMES:
        if name.endswith("_spawn"):
            spawn, popen = StrategyRegistry.get(name), StrategyRegistry.get(name.removesuffix("_spawn"))
            assert spawn._start_method == "spawn" and spawn.lowbit_config == popen.lowbit_config, name


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_trainer_runs_with_each_registered_name(request, name):
    suffix = _suffix(name)
    runs = request.getfixturevalue({"popen": "popen_runs", "spawn": "spawn_runs", "fork": "fork_runs"}[VARIANTS[suffix]])
    r = runs[name]
    optimizer = _optimizer_of(name)
    bitdp = optimizer == "adamw"
    onebit = None if optimizer in ("adamw", "lion") else optimizer
    assert "error" not in r, r.get("error")
    m = r["metrics"]
    assert m["train_loss"] < r["first_loss"], "loss must fall"
    if name.startswith("lowbit_diloco"):  # int4 pseudo-gradients every 3rd step: >= 8x fp32 per step, amortized
        # (2 ranks: 8 steps; the notebook's 3 ranks: 6): 2 rounds either way
        assert m["diloco/rounds"] == 2 and m["diloco/pseudo_grad_norm"] > 0, m
        assert m["comm/ratio_vs_fp32_avg"] > 8, m
        return
    if name.startswith("lowbit_demo"):  # top-4 DCT coefficients of each chunk, 1-bit values
        assert m["comm/ratio_vs_fp32"] > 4 and 0 < m["demo/energy_sent"] < 1 and m["demo/skipped"] == 0, m
        return
    assert m["comm/bytes_per_step"] > 0
    # popen launch: this process was rank 0, so its strategy still holds the run's traffic
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
def test_one_device_trains_and_sends_nothing(tmp_path):
    runs = _plan(tmp_path, {name: ["--strategy", name, "--devices", "1", "--optimizer", optimizer]
                            for name, optimizer in (("lowbit_lion", "lion"), ("lowbit_bitdp", "adamw"))})
    for name, r in runs.items():
        assert "error" not in r, (name, r.get("error"))
        m = r["metrics"]
        assert r["world_size"] == 1 and m["train_loss"] < r["first_loss"], name
        assert m["comm/bytes_per_step"] == 0 and m["comm/ratio_vs_fp32"] == 1.0, name


@pytest.mark.slow
def test_wrong_optimizer_is_a_clear_error(spawn_runs):
    r = spawn_runs["wrong:lion"]
    assert "drives lowbit_strategy.Lion" in r["error"] and "torch.optim.adamw.AdamW" in r["error"]
    assert "'lowbit_lion_spawn'" in r["error"]


@pytest.mark.slow
def test_wrong_optimizer_under_1bit_adam_names_the_fix(spawn_runs):
    r = spawn_runs["wrong:adam"]
    assert "drives lowbit_strategy.OneBitAdam" in r["error"] and "'lowbit_adam_spawn'" in r["error"]


@pytest.mark.slow
@pytest.mark.parametrize("name, optimizer", RESUMED)
def test_1bit_resume_is_bit_exact_and_keeps_every_ranks_errors(fork_runs, name, optimizer):
    # 4 steps an epoch, freeze_step=3: the checkpoint after epoch 1 is one step into compression
    r = fork_runs[f"resume:{name}"]
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
@pytest.mark.parametrize("name, optimizer", BF16)
def test_bf16_mixed_with_accumulation_and_clipping(popen_runs, name, optimizer):
    r = popen_runs[f"bf16:{name}"]
    assert "error" not in r, r.get("error")
    assert r["metrics"]["train_loss"] < r["first_loss"]
    assert r["overlap"] is False, "clipping changes gradients after backward: the sync must wait for step()"
    # 64 samples / (8 x 2 ranks) = 4 batches an epoch, 2 per optimizer step: one sync per real step
    assert r["global_step"] == 6
    if optimizer != "lion":  # steps 4-6 are past freeze_step=3 / warmup_steps=3: compressed momenta
        assert r["metrics"]["comm/ratio_vs_fp32"] > (4 if optimizer == "turboquant" else 10), r["metrics"]


@pytest.mark.slow
def test_unused_parameters_on_some_ranks(spawn_runs):
    r = spawn_runs["unused"]
    assert "error" not in r, r.get("error")
    assert r["metrics"]["comm/bytes_per_step"] > 0


@pytest.mark.slow
def test_resume_is_bit_exact_and_keeps_every_ranks_momentum(fork_runs):
    r = fork_runs["resume:lowbit_lion_1bit_notebook"]
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
def test_bitdp_resume_is_bit_exact_and_keeps_every_ranks_residuals(fork_runs):
    # 64 samples / (8 per batch x 2 ranks) = 4 steps an epoch: the checkpoint is past the warm-up
    r = fork_runs["resume:lowbit_bitdp_notebook"]
    assert "error" not in r, r.get("error")
    assert r == {"bit_exact": True, "saved_world_size": 2, "saved_algorithm": "bitdp", "saved_iters": [4, 4],
                 "residual_names": ["mlp.0.weight", "mlp.2.weight"], "rank_states_differ": True,
                 "other_world_finite": True, "is_global_zero": True}


@pytest.mark.parametrize("name", [n for n, _, _ in SAVED_AFTER_FIT])
@pytest.mark.slow
def test_checkpoint_saved_after_fit_keeps_every_ranks_state(popen_runs, name):
    # popen launch: every rank runs the script, so every rank calls trainer.save_checkpoint after
    # fit, as in a user's script. Teardown has detached the optimizers by then.
    r = popen_runs[f"saved:{name}"]
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


@pytest.mark.slow
def test_diloco_resume_inside_a_round_is_bit_exact_and_keeps_every_workers_weights(fork_runs):
    # 4 steps an epoch on 2 ranks, a round every 3: the checkpoint after epoch 1 is one step into round 2,
    # where the workers' weights and inner AdamW states differ; Lightning saves rank 0's, the rank states the rest
    r = fork_runs["resume:lowbit_diloco_notebook"]
    assert "error" not in r, r.get("error")
    assert r == {"bit_exact": True, "saved_world_size": 2, "saved_algorithm": "diloco", "rank_states_differ": True,
                 "global_same": True, "inner_saved": True, "other_world_finite": True, "is_global_zero": True}


@pytest.mark.slow
def test_demo_resume_with_an_exchange_in_flight_is_bit_exact(fork_runs):
    # delay 1: the checkpoint after epoch 1 holds the last step's gathered payloads, not yet applied,
    # and each worker's own momenta (rank states); the resumed run applies it first
    r = fork_runs["resume:lowbit_demo_notebook"]
    assert "error" not in r, r.get("error")
    assert r == {"bit_exact": True, "saved_world_size": 2, "saved_algorithm": "demo", "rank_states_differ": True,
                 "pending_saved": True, "other_world_finite": True, "is_global_zero": True}
