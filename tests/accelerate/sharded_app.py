"""One node of a 2-node x 2-process ``accelerate launch`` under an FSDP2 config
(``examples/accelerate_fsdp2.yaml``) with :class:`LowBitAccelerator`: FSDP2 inside each node,
the low-bit exchange across nodes. Started once per node by tests/accelerate/test_sharded.py::

    accelerate launch --config_file examples/accelerate_fsdp2.yaml --num_machines 2 --machine_rank K \\
        --num_processes 4 --main_process_ip 127.0.0.1 --main_process_port P tests/accelerate/sharded_app.py --out DIR

Every rank trains the GPT of ``examples/gpt_lion.py`` (tiny) for 6 optimizer steps of 2
micro-batches with clipping, saving at step 3; then the same steps through plain
:func:`lowbit_strategy.attach_sharded`; then a fresh accelerator resumed from the step-3
checkpoint; then a model the script shards itself, with no FSDP plugin; then
``fsdp_shard="world"`` with the int8 reduce-scatter. It writes what it checked to
``DIR/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import lowbit_strategy  # noqa: E402
from examples.gpt_lion import GPT  # noqa: E402

STEPS, SAVE_AT, ACCUMULATE, CLIP, SEQ, BATCH = 6, 3, 2, 1.0, 16, 4


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(seq=SEQ, d=32, layers=2, heads=2, lr=3e-3, optimizer="lion", total_steps=STEPS, warmup=2)


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's micro-batch of an optimizer step: the same in every run."""
    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + 10 * step + micro)
    x = torch.randint(0, 256, (BATCH, SEQ + 1), generator=gen)
    return x[:, :-1], x[:, 1:]


def _loss(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _full(model) -> torch.Tensor:
    """Every parameter, gathered whole (a collective over each node), flattened."""
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()]).detach()


def _same_everywhere(flat: torch.Tensor) -> bool:
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], e) for e in every)


def _accelerator(lowbit=None):
    from accelerate.state import AcceleratorState, GradientState

    from lowbit_strategy.accelerate import LowBitAccelerator

    AcceleratorState._reset_state()
    GradientState._reset_state()
    # the script clips: the exchange is formed at the step, from the clipped gradients
    return LowBitAccelerator(lowbit, gradient_accumulation_steps=ACCUMULATE, overlap=False)


def _train_accelerate(acc, model, opt, schedule, first: int, last: int) -> None:
    for step in range(first, last + 1):
        for micro in range(ACCUMULATE):
            with acc.accumulate(model):
                acc.backward(_loss(model, *_batch(step, micro)))
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                opt.zero_grad()
        schedule.step()


def run_accelerate(ckpt: Path) -> dict:
    acc = _accelerator()
    model = _model()
    built = model.configure_optimizers()  # on the unsharded model, as in any Accelerate script
    opt, schedule = built["optimizer"], built["lr_scheduler"]["scheduler"]
    model, opt = acc.prepare(model, opt)
    acc.register_for_checkpointing(schedule)
    _train_accelerate(acc, model, opt, schedule, 1, SAVE_AT)
    acc.save_state(str(ckpt))
    _train_accelerate(acc, model, opt, schedule, SAVE_AT + 1, STEPS)
    flat = _full(model)
    full = acc.get_state_dict(model)  # (what save_model writes: the main process's full weights)
    named = {n: p.full_tensor() for n, p in model.named_parameters()}
    return {
        "flat": flat,
        "state_dict_full": dist.get_rank() != 0 or all(torch.equal(full[n], t) for n, t in named.items()),
        "distributed_type": acc.distributed_type.name,
        "units": sorted({type(m).__name__ for m in model.modules() if hasattr(m, "set_all_reduce_hook")}),
        "local_fraction": sum(p.to_local().numel() for p in model.parameters()) / flat.numel(),
        "optimizer_holds_shards": all(hasattr(p, "to_local") for g in opt.param_groups for p in g["params"]),
        "bytes_per_step": acc.bytes_sent / STEPS,
        "hsdp_bytes_per_step": acc.ddp_bytes_per_step(),
        "checkpoint": sorted(p.name for p in ckpt.iterdir()),
    }


def run_plain(cfg) -> torch.Tensor:
    """The same model, data and steps through plain ``attach_sharded``."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = lowbit_strategy.node_mesh("cpu", cfg)
    for block in model.blocks:  # the config's units: the Blocks, then the root
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    built = model.configure_optimizers()
    opt, schedule = built["optimizer"], built["lr_scheduler"]["scheduler"]
    sync = lowbit_strategy.attach_sharded(model, [opt], cfg, mesh=mesh)
    sync.disable_overlap("clip_grad_norm_ below")  # as LowBitAccelerator(overlap=False)
    for step in range(1, STEPS + 1):
        for micro in range(ACCUMULATE):
            model.set_requires_gradient_sync(micro == ACCUMULATE - 1)
            (_loss(model, *_batch(step, micro)) / ACCUMULATE).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        schedule.step()
    return _full(model)


def run_resumed(ckpt: Path) -> torch.Tensor:
    acc = _accelerator()
    model = _model()
    built = model.configure_optimizers()
    opt, schedule = built["optimizer"], built["lr_scheduler"]["scheduler"]
    model, opt = acc.prepare(model, opt)
    acc.register_for_checkpointing(schedule)
    acc.load_state(str(ckpt))
    _train_accelerate(acc, model, opt, schedule, SAVE_AT + 1, STEPS)
    return _full(model)


def run_presharded(cfg) -> torch.Tensor:
    """No FSDP plugin (the environment's FSDP config hidden), a model the script sharded itself:
    left as it is, the same result."""
    from torch.distributed.fsdp import fully_shard

    os.environ["ACCELERATE_USE_FSDP"] = "false"
    try:
        acc = _accelerator()
    finally:
        os.environ["ACCELERATE_USE_FSDP"] = "true"
    assert acc.lowbit_fsdp_plugin is None
    model = _model()
    mesh = lowbit_strategy.sharding_mesh("cpu", cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    built = model.configure_optimizers()  # on the sharded model
    opt, schedule = built["optimizer"], built["lr_scheduler"]["scheduler"]
    model, opt = acc.prepare(model, opt)
    _train_accelerate(acc, model, opt, schedule, 1, STEPS)
    return _full(model)


def run_world(cfg) -> dict:
    """fsdp_shard='world' with the int8 reduce-scatter, from the config alone: one FSDP group
    over every rank."""
    acc = _accelerator(cfg.replace(fsdp_shard="world", fsdp_reduce_scatter="int8"))
    model = _model()
    built = model.configure_optimizers()
    opt, schedule = built["optimizer"], built["lr_scheduler"]["scheduler"]
    model, opt = acc.prepare(model, opt)
    _train_accelerate(acc, model, opt, schedule, 1, STEPS)
    flat = _full(model)
    return {"finite": bool(torch.isfinite(flat).all()), "identical": _same_everywhere(flat),
            "local_fraction": sum(p.to_local().numel() for p in model.parameters()) / flat.numel(),
            "bytes": acc.bytes_sent}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    out = Path(parser.parse_args().out)
    torch.set_num_threads(1)
    ckpt = out / "ckpt"
    result = run_accelerate(ckpt)
    flat = result.pop("flat")
    cfg = lowbit_strategy.LowBitConfig.from_env()
    result.update(
        rank=dist.get_rank(),
        finite=bool(torch.isfinite(flat).all()),
        identical=_same_everywhere(flat),
        equals_plain=torch.equal(flat, run_plain(cfg)),
        resume_bit_exact=torch.equal(flat, run_resumed(ckpt)),
        presharded_equal=torch.equal(flat, run_presharded(cfg)),
        world=run_world(cfg),
        rank_files=sorted(p.name for p in (ckpt / "lowbit_rank_states" / "model_0").iterdir()),
    )
    with open(out / f"rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # without interpreter finalization (tests/distributed.py has the same exit, and why)


if __name__ == "__main__":
    main()
