"""Train the small GPT of ``gpt_lion.py`` with Hugging Face Accelerate and ``LowBitAccelerator``.

The script is an ordinary Accelerate training loop; the one low-bit line is
``LowBitAccelerator(...)`` in place of ``Accelerator(...)``. The algorithm and its settings
come from the environment the launcher passes on (``LOWBIT_CONFIG`` = a YAML file,
``LOWBIT_<FIELD>`` overrides)::

    LOWBIT_CONFIG=examples/lowbit.yaml accelerate launch --config_file examples/accelerate.yaml examples/accelerate_gpt.py
    LOWBIT_CONFIG=examples/lowbit.yaml LOWBIT_ALGORITHM=bitdp accelerate launch --config_file examples/accelerate.yaml \\
        examples/accelerate_gpt.py --steps 100 --accumulate 2 --clip 1.0 --mixed-precision bf16

With ``--config_file examples/accelerate_fsdp2.yaml`` (``distributed_type: FSDP``, ``fsdp_version: 2``)
the same script trains sharded: FSDP2 inside each node, the low-bit exchange across nodes
(start it once per node with ``--num_machines N --machine_rank K``); the fp32 figure it prints
is then HSDP's all-reduce of each rank's shards across nodes.

Data and model are those of ``gpt_lion.py``: the bytes of the installed Python standard
library (real text, offline), byte-level tokens, 10% held out; a GPT with tied embeddings.
At the end the main process prints the validation loss, steps/s, the bytes each rank sent
per step next to what DDP's fp32 allreduce would have sent, and whether every rank holds
the same weights.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from accelerate.utils import set_seed
from torch.nn import functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.causal_lm import split_windows  # noqa: E402
from examples.gpt_lion import GPT, stdlib_bytes  # noqa: E402
from lowbit_strategy.accelerate import LowBitAccelerator  # noqa: E402

#: the optimizer each algorithm drives (the example's choice for ``--optimizer auto``;
#: BitDP compresses gradients, so any optimizer works there)
OPTIMIZER_FOR = {"lion": "lion", "bitdp": "adamw", "onebit_adam": "onebit_adam", "onebit_lamb": "onebit_lamb",
                 "turboquant": "turboquant", "diloco": "adamw", "demo": "demo"}


def _clip_or_none(value: str):
    """``none`` -> None, ``auto`` -> "auto", else a number (the optimizer validates it)."""
    return None if value == "none" else value if value == "auto" else float(value)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--optimizer", default="auto",
                   choices=["auto", "lion", "adamw", "onebit_adam", "onebit_lamb", "turboquant", "demo"],
                   help="auto: the one the configured algorithm drives")
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 for Lion and DeMo, 3e-3 for the others")
    p.add_argument("--update-clip", default="auto", type=_clip_or_none,
                   help="1-bit Adam/LAMB: bound on each compressed step (auto: Adam's; none: the papers' form)")
    p.add_argument("--guard", default=1000.0, type=_clip_or_none,
                   help="1-bit Adam/LAMB: stop when a step is this many times the warm-up's (none: never)")
    p.add_argument("--batch-size", type=int, default=16, help="per rank and micro-batch")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--clip", type=float, default=0.0, help="clip the gradient norm to this (0: no clipping)")
    p.add_argument("--mixed-precision", default=None, choices=["no", "bf16", "fp16"],
                   help="default: the launcher's (accelerate config / --mixed_precision)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--data-mb", type=float, default=6.0)
    p.add_argument("--val-batches", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default="", help="accelerator.save_state here at the end")
    p.add_argument("--resume", default="", help="accelerator.load_state from here first")
    p.add_argument("--out", default="", help="write a JSON summary here (main process)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    # Clipping changes gradients after backward: the synchronized update must then be
    # formed in optimizer.step(), not during backward.
    accelerator = LowBitAccelerator(overlap=not args.clip, gradient_accumulation_steps=args.accumulate,
                                    mixed_precision=args.mixed_precision)
    cfg = accelerator.lowbit_config
    set_seed(args.seed)
    tokens = stdlib_bytes(int(args.data_mb * 2**20))
    train_set, val_set = split_windows(tokens, args.seq)  # the last 10 % held out
    train = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val = DataLoader(val_set, batch_size=args.batch_size)
    optimizer = OPTIMIZER_FOR.get(cfg.algorithm, "adamw") if args.optimizer == "auto" else args.optimizer
    lr = args.lr or (1e-3 if optimizer in ("lion", "demo") else 3e-3)
    model = GPT(seq=args.seq, d=args.d_model, layers=args.layers, lr=lr, optimizer=optimizer,
                total_steps=args.steps, warmup=max(1, min(50, args.steps // 10)), update_clip=args.update_clip,
                guard=args.guard)
    # the optimizer and its warm-up + cosine schedule of gpt_lion.py, stepped once per optimizer step
    built = model.configure_optimizers()
    opt, schedule = built["optimizer"], built["lr_scheduler"]["scheduler"]
    model, opt, train, val = accelerator.prepare(model, opt, train, val)
    accelerator.register_for_checkpointing(schedule)
    if args.resume:
        accelerator.load_state(args.resume)

    step, first_loss, loss, seconds = 0, None, torch.tensor(float("nan")), 0.0
    model.train()
    while step < args.steps:
        for x, y in train:
            start = time.perf_counter()
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                accelerator.backward(loss)
                if args.clip and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip)
                opt.step()
                opt.zero_grad()
            seconds += time.perf_counter() - start
            if accelerator.sync_gradients:
                schedule.step()
                step += 1
                first_loss = float(loss.detach()) if first_loss is None else first_loss
                if step >= args.steps:
                    break
    if args.save:
        accelerator.save_state(args.save)

    summary = {
        "algorithm": cfg.algorithm, "section": cfg.section.to_dict(), "optimizer": optimizer,
        "overlap": accelerator.lowbit_overlap,
        "world_size": accelerator.num_processes, "distributed_type": accelerator.distributed_type.name,
        "mixed_precision": str(accelerator.mixed_precision),
        "params": sum(p.numel() for p in model.parameters()), "steps": step,
        "first_loss": first_loss, "train_loss": float(loss.detach()), "val_loss": evaluate(accelerator, model, val, args),
        "steps_per_s": step / seconds if seconds else 0.0,
        "bytes_per_step": accelerator.bytes_sent / max(1, step),
        "ddp_bytes_per_step": accelerator.ddp_bytes_per_step(),
        "sharded": accelerator.lowbit_fsdp_plugin is not None,
        "fp32": "HSDP's fp32 all-reduce" if accelerator.lowbit_fsdp_plugin is not None else "DDP fp32",
        "replicas_identical": replicas_identical(accelerator, model),
    }
    if accelerator.is_main_process:
        report(summary)
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=2))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return summary


@torch.no_grad()
def evaluate(accelerator, model, val, args) -> float:
    """Mean validation loss over the first ``--val-batches`` batches of every rank."""
    model.eval()
    total, count = torch.zeros((), device=accelerator.device), 0
    for i, (x, y) in enumerate(val):
        if i >= args.val_batches:
            break
        total += F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        count += 1
    model.train()
    return float(accelerator.reduce(total / max(1, count), reduction="mean"))


@torch.no_grad()
def replicas_identical(accelerator, model) -> bool:
    """Whether every rank holds bit-identical weights (each rank's weights, gathered as bytes; a
    sharded parameter gathered whole first, a collective)."""
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1).float() for p in full]).view(torch.int32)
    copies = accelerator.gather(flat[None])
    return bool((copies == copies[0]).all())


def report(s: dict) -> None:
    sent, ddp = s["bytes_per_step"], s["ddp_bytes_per_step"]
    if sent and ddp:
        saving = f"{ddp / sent:.1f}x less ({100 * (1 - sent / ddp):.1f}% saved)"
    else:
        saving = "nothing to synchronize on one process"
    settings = ", ".join(f"{k}={v}" for k, v in s["section"].items() if k != "overlap")
    if not s["overlap"]:
        settings += "; synchronized in optimizer.step() (gradients clipped after backward)"
    print(
        f"\nLowBitAccelerator: {s['algorithm']} ({settings}) with {s['optimizer']}\n"
        f"  {s['world_size']} processes ({s['distributed_type']}, mixed precision {s['mixed_precision']}), "
        f"{s['params'] / 1e6:.2f}M parameters, {s['steps']} steps\n"
        f"  validation loss      {s['val_loss']:.4f}   (train {s['train_loss']:.4f}, first step {s['first_loss']:.4f})\n"
        f"  steps/s              {s['steps_per_s']:.2f}\n"
        f"  bytes sent per step  {sent / 1024:.1f} KiB per rank; {s['fp32']} would send {ddp / 1024:.1f} KiB: "
        f"{saving}\n"
        f"  replicas identical   {'yes' if s['replicas_identical'] else 'NO'}",
        flush=True,
    )


if __name__ == "__main__":
    main()
    if torch.distributed.is_available() and torch.distributed.is_initialized():  # every rank done first
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
