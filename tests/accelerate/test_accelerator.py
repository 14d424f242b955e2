"""LowBitAccelerator on real gloo process groups, against DDP on the same data.

Each rank builds its own accelerator inside a ``run_ranks`` worker: the launcher's
environment (RANK, WORLD_SIZE, LOCAL_RANK) is set as ``accelerate launch`` would, and no
``cpu=True`` is passed, so these runs also check that the accelerator forms one gloo group
on a machine without GPUs by itself.
"""
import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs, DistributedType  # noqa: E402

import lowbit_strategy  # noqa: E402
from lowbit_strategy import ConfigError, LowBitConfig, LowBitSetupError  # noqa: E402
from lowbit_strategy import rank_state  # noqa: E402
from lowbit_strategy.accelerate import STATE_FILE, LowBitAccelerator  # noqa: E402
from tests.algorithms.lion_cub.test_optimizer import BETAS, LR, WD, _batch, _model  # noqa: E402
from tests.distributed import run_ranks  # noqa: E402

STEPS = 6
BUCKET_MB = 0.0005  # several DDP buckets for the tiny model, so buckets overlap backward


def _fresh_accelerator(rank, world_size, lowbit, **kwargs) -> LowBitAccelerator:
    """A new accelerator in this process, with the environment ``accelerate launch`` gives a rank."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    return LowBitAccelerator(lowbit, **kwargs)


def _micro_batch(rank, step, micro):
    return _batch(rank, 100 * step + micro)


def _train(acc, model, opt, rank, first, last, clip=None):
    """Steps ``first..last``, each of ``acc.gradient_accumulation_steps`` micro-batches."""
    for step in range(first, last + 1):
        for micro in range(acc.gradient_accumulation_steps):
            with acc.accumulate(model):
                x, y = _micro_batch(rank, step, micro)
                acc.backward(nn.functional.cross_entropy(model(x), y))
                if clip is not None and acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()


def _ddp_lion_reference(rank, accumulate):
    """DDP + plain Lion on the same micro-batches, DDP's no_sync on all but the last."""
    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = lowbit_strategy.Lion(ddp.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    for step in range(1, STEPS + 1):
        for micro in range(accumulate):
            ctx = ddp.no_sync() if micro < accumulate - 1 else contextlib.nullcontext()
            with ctx:
                x, y = _micro_batch(rank, step, micro)
                (nn.functional.cross_entropy(ddp(x), y) / accumulate).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in ddp.module.parameters()]


def _replicas(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.detach().contiguous())
    return out


def _assert_ranks_identical(model, what):
    for p in model.parameters():
        copies = _replicas(p)
        assert all(torch.equal(copies[0], c) for c in copies[1:]), f"{what}: replicas differ"


def lion_section(params):
    return lowbit_strategy.Lion(params, lr=LR, betas=BETAS, weight_decay=WD)


# ---- exactness and identical replicas ---------------------------------------------------
def _check_exact_mode_equals_ddp_lion(rank, world_size):
    # fp32 mode + momentum sync every step: Lion on the DDP-averaged gradient, here with
    # gradient accumulation (the hook runs on the last micro-batch only) and overlap on
    acc = _fresh_accelerator(rank, world_size, dict(algorithm="lion", mode="fp32", momentum_sync_every=1,
                                                    momentum_sync_layers="all", bucket_size_mb=BUCKET_MB),
                             gradient_accumulation_steps=2)
    assert acc.distributed_type == DistributedType.MULTI_CPU and acc.num_processes == world_size
    model, opt = acc.prepare(_model(), None)[0], None
    opt = acc.prepare(lion_section(model.parameters()))  # optimizer prepared after the model: attached then
    assert isinstance(model, nn.parallel.DistributedDataParallel) and len(acc.lowbit_syncs) == 1
    _train(acc, model, opt, rank, 1, STEPS)
    for a, b in zip(model.module.parameters(), _ddp_lion_reference(rank, accumulate=2)):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=1e-6)
    assert acc.bytes_sent > 0 and acc.ddp_bytes_per_step() > 0


#: every registered algorithm -> its compressed config and the optimizer it drives (a new
#: algorithm needs an entry here: the Accelerate front end must run it too)
ALGORITHM_RUNS = {
    "lion": (dict(mode="1bit"), lambda ps: lion_section(ps)),
    "bitdp": (dict(bits=1, error_feedback=True), lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
    "onebit_adam": ({}, lambda ps: lowbit_strategy.OneBitAdam(ps, lr=1e-2, freeze_step=2)),
    "onebit_lamb": ({}, lambda ps: lowbit_strategy.OneBitLamb(ps, lr=1e-2, freeze_step=2)),
    # a fixed form: "auto" plans from this machine's codec timing, which a loaded machine can
    # tip to "fp32" or to another form between two runs (auto's own resume: below)
    "turboquant": (dict(form="two_stage"), lambda ps: lowbit_strategy.TurboQuantAdamW(ps, lr=1e-2, warmup_steps=2)),
    # local updates under the user's AdamW: a round every 3 of the 6 steps (the run ends at a round's end)
    "diloco": (dict(sync_every=3, compression="int4"), lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
    # decoupled momentum: top-4 DCT coefficients per chunk, 1-bit values, the update a step late
    "demo": (dict(values="sign", delay=1), lambda ps: lowbit_strategy.DeMo(ps, lr=1e-2, compression_topk=4)),
}


def _algorithm_runs():
    missing = set(lowbit_strategy.ALGORITHMS) - set(ALGORITHM_RUNS)
    assert not missing, f"add {sorted(missing)} to ALGORITHM_RUNS (config and optimizer)"
    return {name: ({"algorithm": name, **cfg}, make) for name, (cfg, make) in ALGORITHM_RUNS.items()
            if name in lowbit_strategy.ALGORITHMS}


def _check_compressed_modes_keep_ranks_identical(rank, world_size):
    runs = list(_algorithm_runs().values()) + [
        (dict(algorithm="lion", mode="lp", bits=8), lion_section, dict(gradient_accumulation_steps=2)),
    ]
    for run in runs:
        cfg, make_opt, kwargs = run if len(run) == 3 else (*run, {})
        acc = _fresh_accelerator(rank, world_size, {**cfg, "bucket_size_mb": BUCKET_MB}, **kwargs)
        model = acc.prepare(_model())
        opt = acc.prepare(make_opt(model.parameters()))
        _train(acc, model, opt, rank, 1, STEPS)
        _assert_ranks_identical(model, cfg)
        sent, ddp = acc.bytes_sent, acc.ddp_bytes_per_step() * STEPS
        assert 0 < sent < ddp, (cfg, sent, ddp)  # compressed: less than DDP's fp32 allreduce
        if cfg["algorithm"] == "bitdp":  # 1-bit codes after DDP's two warm-up iterations
            assert "gathered.codes.all_gather" in {r.op for lg in acc.traffic_logs() for r in lg.records}


def _check_sync_each_batch_synchronizes_once_per_step(rank, world_size):
    # sync_each_batch runs the DDP hook on every micro-batch: the accelerator moves the
    # synchronization to step(), so the run equals one created with overlap=False bit for
    # bit and sends the same bytes (one collective per bucket and step, not per micro-batch)
    from accelerate.utils import GradientAccumulationPlugin

    cfg = dict(algorithm="lion", mode="1bit", bucket_size_mb=BUCKET_MB)
    results = []
    for plugin, overlap in ((GradientAccumulationPlugin(num_steps=2), False),
                            (GradientAccumulationPlugin(num_steps=2, sync_each_batch=True), True)):
        acc = _fresh_accelerator(rank, world_size, cfg, gradient_accumulation_plugin=plugin, overlap=overlap)
        model = acc.prepare(_model())
        opt = acc.prepare(lion_section(model.parameters()))
        _train(acc, model, opt, rank, 1, 3)
        results.append(([p.detach().clone() for p in model.parameters()], acc.bytes_sent))
    (at_step, at_step_bytes), (each, each_bytes) = results
    assert all(torch.equal(a, b) for a, b in zip(at_step, each))
    assert each_bytes == at_step_bytes > 0


def _check_bf16_accumulation_and_clipping(rank, world_size):
    for cfg, make_opt in [(dict(algorithm="lion", mode="1bit"), lion_section),
                          (dict(algorithm="bitdp", bits=2), lambda ps: torch.optim.AdamW(ps, lr=1e-2))]:
        acc = _fresh_accelerator(rank, world_size, {**cfg, "bucket_size_mb": BUCKET_MB}, overlap=False,
                                 mixed_precision="bf16", gradient_accumulation_steps=2)
        assert acc.mixed_precision == "bf16"
        model = acc.prepare(_model())
        opt = acc.prepare(make_opt(model.parameters()))
        before = [p.detach().clone() for p in model.parameters()]
        _train(acc, model, opt, rank, 1, 3, clip=0.5)
        _assert_ranks_identical(model, cfg)
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "nothing trained"
        assert acc.bytes_sent > 0


# ---- errors: the same as the Lightning strategy's ---------------------------------------
def _check_errors(rank, world_size):
    acc = _fresh_accelerator(rank, world_size, dict(algorithm="lion", bucket_size_mb=BUCKET_MB))
    model = acc.prepare(_model())
    with pytest.raises(LowBitSetupError, match=r"LowBitAccelerator\(algorithm='lion'\) drives lowbit_strategy\.Lion"
                                               r".*torch\.optim\.adamw\.AdamW.*bitdp"):
        acc.prepare(torch.optim.AdamW(model.parameters()))
    acc = _fresh_accelerator(rank, world_size, dict(algorithm="onebit_adam"))
    model = acc.prepare(_model())
    with pytest.raises(LowBitSetupError, match=r"drives lowbit_strategy\.OneBitAdam.*got torch\.optim\.sgd\.SGD"):
        acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    # a lane too narrow for any world size: refused where the config is made, not at the first backward
    with pytest.raises(lowbit_strategy.ConfigError, match=r"lion\.bits: got 2; with mode='lp' allowed: None, 4"):
        _fresh_accelerator(rank, world_size, dict(algorithm="lion", mode="lp", bits=2))
    # clipping after an overlapped backward would be silently wrong: refused, naming the fix
    acc = _fresh_accelerator(rank, world_size, dict(algorithm="lion", mode="1bit", bucket_size_mb=BUCKET_MB))
    model = acc.prepare(_model())
    opt = acc.prepare(lion_section(model.parameters()))
    with pytest.raises(LowBitSetupError, match=r"overlap=False"):
        _train(acc, model, opt, rank, 1, 1, clip=1.0)


# ---- resume -------------------------------------------------------------------------------
def _run(rank, world_size, cfg, make_opt, last, save_to=None, resume_from=None):
    acc = _fresh_accelerator(rank, world_size, {**cfg, "bucket_size_mb": BUCKET_MB})
    model = acc.prepare(_model())
    opt = acc.prepare(make_opt(model.parameters()))
    first = 1
    if resume_from is not None:
        acc.load_state(resume_from)
        first = 4
    _train(acc, model, opt, rank, first, last)
    if save_to is not None:
        acc.save_state(save_to)
    return acc, model


def _check_resume(rank, world_size, tmp):
    runs = _algorithm_runs()
    for name, (cfg, make_opt) in runs.items():
        _, straight = _run(rank, world_size, cfg, make_opt, STEPS)
        expected = [p.detach().clone() for p in straight.parameters()]
        where = os.path.join(tmp, name)
        half, _ = _run(rank, world_size, cfg, make_opt, 3, save_to=where)
        saved = torch.load(os.path.join(where, STATE_FILE), weights_only=True)
        assert saved["algorithm"] == name and saved["models"][0] == {"world_size": world_size, "format": "files"}
        # every rank's own state is in a file of its own, and the ranks' states differ
        states = [torch.load(rank_state._file(os.path.join(where, "lowbit_rank_states", "model_0"), r, world_size),
                             weights_only=True) for r in range(world_size)]
        own = half.lowbit_syncs[0].state_dict()
        assert _flat(states[rank]) and all(torch.equal(a, b) for a, b in zip(_flat(states[rank]), _flat(own)))
        assert any(not torch.equal(a, b) for a, b in zip(_flat(states[0]), _flat(states[1]))), name
        _, resumed = _run(rank, world_size, cfg, make_opt, STEPS, resume_from=where)
        assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), expected)), f"{name}: resume not exact"


#: ``auto`` plans measured at attach, forced through their measurement: (the module whose
#: ``measure_codec_seconds`` the communicator calls, the choice of the first runs, the choice a
#: fresh measurement on resume would make)
AUTO_PLANS = {
    "lion": ("lowbit_strategy.algorithms.lion_cub.communicator", "lp8", "bf16"),
    "turboquant": ("lowbit_strategy.algorithms.turboquant.communicator", "two_stage", "bf16"),
}


@contextlib.contextmanager
def _measured_as(module_name: str, cheapest: str):
    """Every codec measurement says ``cheapest`` costs nothing and the others a second per
    element (or per bucket): ``auto`` then picks ``cheapest``."""
    import importlib

    module = importlib.import_module(module_name)
    real = module.measure_codec_seconds

    def fake(*args, **kwargs):
        return {name: 0.0 if name == cheapest else 1.0 for name in real(*args, **kwargs)}

    module.measure_codec_seconds = fake
    try:
        yield
    finally:
        module.measure_codec_seconds = real


def _check_resume_keeps_the_measured_plan(rank, world_size, tmp):
    """``auto`` resolves its plan from codec time measured at attach. A resumed run keeps the
    plan its checkpoint was saved with, even where its own measurement would choose another
    (here forced: the first runs see one choice cheapest, the resumed run the other), and so
    continues exactly as the run that never stopped."""
    for name, (module, first, then) in AUTO_PLANS.items():
        cfg, make_opt = _algorithm_runs()[name]
        cfg = {**cfg, ("mode" if name == "lion" else "form"): "auto"}
        with _measured_as(module, first):
            _, straight = _run(rank, world_size, cfg, make_opt, STEPS)
            _run(rank, world_size, cfg, make_opt, 3, save_to=os.path.join(tmp, f"auto-{name}"))
        with _measured_as(module, then):
            acc, resumed = _run(rank, world_size, cfg, make_opt, STEPS, resume_from=os.path.join(tmp, f"auto-{name}"))
            _, other = _run(rank, world_size, cfg, make_opt, STEPS)  # what that measurement alone would do
        comm = acc.lowbit_syncs[0].optimizers[0].communicator
        chosen = comm.plan.mode if name == "lion" else set(comm.forms.values())
        assert chosen in (first[:2], {first}), (name, chosen)
        assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), straight.parameters())), name
        assert not all(torch.equal(a, b) for a, b in zip(other.parameters(), straight.parameters())), name


def _flat(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _flat(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _flat(v)]
    return []


def _check_failures_reach_every_rank(rank, world_size, tmp):
    """A save that fails on one rank, a checkpoint one rank cannot see, a state file missing on
    one rank: every rank raises the same error, naming the rank, instead of waiting for it."""
    import accelerate.accelerator as acc_module

    cfg = dict(algorithm="lion", mode="1bit", bucket_size_mb=BUCKET_MB)
    acc = _fresh_accelerator(rank, world_size, cfg)
    model = acc.prepare(_model())
    opt = acc.prepare(lion_section(model.parameters()))
    _train(acc, model, opt, rank, 1, 2)
    where = os.path.join(tmp, "failures")
    real = acc_module.save_accelerator_state

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    acc_module.save_accelerator_state = disk_full if rank == 0 else real  # the main process's write fails
    try:
        with pytest.raises(RuntimeError, match=r"save_state failed on rank\(s\) \[0\]"):
            acc.save_state(where)
    finally:
        acc_module.save_accelerator_state = real
    acc.save_state(where)  # a good save
    with pytest.raises(RuntimeError, match=r"load_state failed on rank\(s\) \[1\]"):
        acc.load_state(where if rank == 0 else where + "-not-there")  # rank 1 cannot see the checkpoint
    dist.barrier()
    if rank == 1:  # rank 1 cannot see its own state file
        os.remove(rank_state._file(os.path.join(where, "lowbit_rank_states", "model_0"), 1, world_size))
    dist.barrier()
    with pytest.raises(FileNotFoundError, match=r"rank\(s\) \[1\] cannot see"):
        acc.load_state(where)


def _check_all(rank, world_size, tmp):
    _check_exact_mode_equals_ddp_lion(rank, world_size)
    _check_compressed_modes_keep_ranks_identical(rank, world_size)
    _check_sync_each_batch_synchronizes_once_per_step(rank, world_size)
    _check_bf16_accumulation_and_clipping(rank, world_size)
    _check_errors(rank, world_size)
    _check_resume(rank, world_size, tmp)
    _check_resume_keeps_the_measured_plan(rank, world_size, tmp)
    _check_failures_reach_every_rank(rank, world_size, tmp)


@pytest.mark.slow
def test_low_bit_accelerator_on_two_gloo_ranks(tmp_path):
    run_ranks(2, _check_all, str(tmp_path))


# ---- one process: configuration and setup errors -------------------------------------------
@pytest.fixture
def fresh_state(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "ACCELERATE_MIXED_PRECISION"):
        monkeypatch.delenv(var, raising=False)
    for var in [v for v in os.environ if v.startswith("LOWBIT_")]:
        monkeypatch.delenv(var)
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    yield monkeypatch
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_config_comes_from_the_launchers_environment(fresh_state, tmp_path):
    path = tmp_path / "lowbit.yaml"
    path.write_text("algorithm: lion\nbucket_size_mb: 4\nlion:\n  mode: lp\n  bits: 8\n")
    fresh_state.setenv("LOWBIT_CONFIG", str(path))
    fresh_state.setenv("LOWBIT_BITS", "16")
    acc = LowBitAccelerator(cpu=True)
    cfg = acc.lowbit_config
    assert (cfg.algorithm, cfg.lion.mode, cfg.lion.bits, cfg.bucket_size_mb) == ("lion", "lp", 16, 4.0)
    assert acc.ddp_handler.bucket_cap_mb == 4.0  # DDP's buckets are the ones the hook compresses


def test_explicit_config_ignores_the_environment_and_bad_variables_are_named(fresh_state):
    fresh_state.setenv("LOWBIT_ALGORITHM", "bitdp")
    acc = LowBitAccelerator({"algorithm": "lion", "mode": "1bit"}, cpu=True)
    assert acc.lowbit_config == LowBitConfig(algorithm="lion", mode="1bit")
    AcceleratorState._reset_state(reset_partial_state=True)
    fresh_state.setenv("LOWBIT_BITZ", "1")
    with pytest.raises(ConfigError, match="LOWBIT_BITZ"):
        LowBitAccelerator(cpu=True)


def test_fp16_is_refused_by_algorithms_that_keep_gradients_local(fresh_state):
    for algorithm in ("lion", "onebit_adam", "onebit_lamb"):
        with pytest.raises(LowBitSetupError, match=r"precision='bf16-mixed'"):
            LowBitAccelerator({"algorithm": algorithm}, mixed_precision="fp16", cpu=True)
    fresh_state.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # what `accelerate launch --mixed_precision` sets
    with pytest.raises(LowBitSetupError, match=r"16-mixed"):
        LowBitAccelerator({"algorithm": "lion"}, cpu=True)


def test_ddp_kwargs_keep_an_explicit_bucket_size_and_refuse_a_second_hook(fresh_state):
    acc = LowBitAccelerator({"algorithm": "bitdp"}, cpu=True,
                            kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=3, static_graph=True)])
    assert (acc.ddp_handler.bucket_cap_mb, acc.ddp_handler.static_graph) == (3, True)
    AcceleratorState._reset_state(reset_partial_state=True)
    with pytest.raises(LowBitSetupError, match=r"remove comm_hook='fp16' from DistributedDataParallelKwargs"):
        LowBitAccelerator({"algorithm": "bitdp"}, cpu=True,
                          kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)])


def test_one_process_trains_plainly_and_sends_nothing(fresh_state, tmp_path):
    acc = LowBitAccelerator({"algorithm": "lion", "mode": "1bit"}, cpu=True)
    assert acc.distributed_type == DistributedType.NO
    reference = _model()
    ref_opt = lion_section(reference.parameters())
    model = acc.prepare(_model())
    opt = acc.prepare(lion_section(model.parameters()))
    for step in range(1, 4):
        for m, o in ((model, opt), (reference, ref_opt)):
            x, y = _batch(0, step)
            loss = nn.functional.cross_entropy(m(x), y)
            acc.backward(loss) if m is model else loss.backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert acc.lowbit_syncs == [] and acc.bytes_sent == 0 and acc.ddp_bytes_per_step() == 0
    acc.save_state(str(tmp_path / "ckpt"))  # nothing rank-local to add with one process
    assert not (tmp_path / "ckpt" / STATE_FILE).exists()
    acc.load_state(str(tmp_path / "ckpt"))
