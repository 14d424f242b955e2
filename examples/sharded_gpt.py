"""Train the small GPT of ``gpt_lion.py`` sharded: FSDP2 inside each node, low-bit across nodes.

A plain PyTorch loop under ``torchrun``. The model's blocks, then the root, are
``fully_shard``-ed over the node (``mesh["shard"]`` of :func:`lowbit_strategy.sharding_mesh`);
:func:`lowbit_strategy.attach_sharded` runs the algorithm's exchange across nodes on each
rank's shards, and the optimizer steps only the shard (its state is 1/L of a replica's).

Two emulated nodes of two ranks on one machine (CPU, gloo)::

    torchrun --nproc-per-node 4 examples/sharded_gpt.py --ranks-per-node 2 --algorithm lion --steps 100
    torchrun --nproc-per-node 4 examples/sharded_gpt.py --ranks-per-node 2 --algorithm onebit_adam \\
        --steps 100 --accumulate 2 --bf16

A model that does not fit in one node: one FSDP group over every rank, its reduce-scatter
quantized (two hops: exact inside each node, 4-bit codes across)::

    torchrun --nproc-per-node 4 examples/sharded_gpt.py --ranks-per-node 2 --algorithm lion --steps 100 \
        --lowbit fsdp_shard=world fsdp_reduce_scatter=int4

Real nodes: start it once per node (``torchrun --nnodes N --node-rank K --nproc-per-node L
--rdzv-endpoint HOST:PORT ...``); the node layout comes from torchrun's ``LOCAL_WORLD_SIZE``.
At the end rank 0 prints the validation loss, steps/s, the bytes each rank sent across nodes
per step next to what HSDP's fp32 all-reduce of the same shards sends, and the optimizer
state bytes per rank. ``--save DIR`` writes a checkpoint (model and optimizer through
``torch.distributed.checkpoint``, every rank's own low-bit state beside it); ``--resume DIR``
continues from one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lowbit_strategy  # noqa: E402
from examples.causal_lm import split_windows  # noqa: E402
from examples.gpt_lion import GPT, stdlib_bytes  # noqa: E402
from lowbit_strategy.collectives import wire  # noqa: E402

#: the optimizer each sharded algorithm drives (GPT's ``optimizer`` names)
OPTIMIZER_FOR = {"lion": "lion", "onebit_adam": "onebit_adam", "onebit_lamb": "onebit_lamb", "turboquant": "turboquant", "bitdp": "adamw"}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm", default="lion", choices=sorted(OPTIMIZER_FOR))
    p.add_argument("--lowbit", nargs="*", default=[], metavar="FIELD=VALUE", help="LowBitConfig overrides")
    p.add_argument("--ranks-per-node", type=int, default=None, help="default: torchrun's LOCAL_WORLD_SIZE")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps")
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 for Lion, 3e-3 for the others")
    p.add_argument("--batch-size", type=int, default=16, help="per rank and micro-batch")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--data-mb", type=float, default=2.0)
    p.add_argument("--val-batches", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", default="", help="checkpoint directory written at the end")
    p.add_argument("--resume", default="", help="checkpoint directory to continue from")
    p.add_argument("--out", default="", help="write a JSON summary here (rank 0)")
    return p.parse_args(argv)


def shard(model: GPT, mesh, bf16: bool) -> GPT:
    """Each block, then the root (embeddings, final norm, tied head), over the node."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if bf16 else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"], **kw)
    fully_shard(model, mesh=mesh["shard"], **kw)
    return model


def main(argv=None) -> dict:
    args = parse(argv)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else None
    backend = "cpu:gloo,cuda:nccl" if device is not None else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=120))
    if device is not None:
        torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    overrides = dict(kv.split("=", 1) for kv in args.lowbit)
    cfg = lowbit_strategy.LowBitConfig.coerce(None, algorithm=args.algorithm, ranks_per_node=args.ranks_per_node,
                                              **overrides)
    mesh = lowbit_strategy.sharding_mesh(device.type if device is not None else "cpu", cfg)

    torch.manual_seed(args.seed)
    tokens = stdlib_bytes(int(args.data_mb * 2**20))
    train_set, val_set = split_windows(tokens, args.seq)
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, seed=args.seed, drop_last=True)
    train = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    val = DataLoader(val_set, batch_size=args.batch_size)
    optimizer = OPTIMIZER_FOR[cfg.algorithm]
    lr = args.lr or (1e-3 if optimizer == "lion" else 3e-3)
    model = GPT(seq=args.seq, d=args.d_model, layers=args.layers, lr=lr, optimizer=optimizer,
                total_steps=args.steps, warmup=max(1, min(50, args.steps // 10)))
    if device is not None:
        model = model.to(device)
    shard(model, mesh, args.bf16)
    built = model.configure_optimizers()  # after sharding: the optimizer holds the DTensor shards
    opt, schedule = built["optimizer"], built["lr_scheduler"]["scheduler"]
    sync = lowbit_strategy.attach_sharded(model, [opt], cfg, mesh=mesh)
    start_step = load(args.resume, model, opt, schedule, sync) if args.resume else 0

    step, loss, seconds, first_loss = start_step, torch.tensor(float("nan")), 0.0, None
    model.train()
    epoch = 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        batches = iter(train)
        while step < args.steps:
            micro = [next(batches, None) for _ in range(args.accumulate)]
            if any(b is None for b in micro):
                break
            begin = time.perf_counter()
            opt.zero_grad()
            for i, (x, y) in enumerate(micro):
                model.set_requires_gradient_sync(i == len(micro) - 1)  # one exchange per optimizer step
                if device is not None:
                    x, y = x.to(device), y.to(device)
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()) / len(micro)
                loss.backward()
            opt.step()
            schedule.step()
            seconds += time.perf_counter() - begin
            step += 1
            first_loss = float(loss.detach()) * len(micro) if first_loss is None else first_loss
        epoch += 1
    if args.save:
        save(args.save, model, opt, schedule, sync, step)

    local = sum(p.to_local().numel() for p in model.parameters())
    sent = sum(log.bytes_sent for log in sync.traffic_logs())
    state = sum(v.to_local().numel() * v.element_size() if hasattr(v, "to_local") else v.numel() * v.element_size()
                for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    summary = {
        "algorithm": cfg.algorithm, "world_size": world, "nodes": mesh["replicate"].size(),
        "ranks_per_node": mesh["shard"].size(), "params": sum(p.numel() for p in model.parameters()),
        "local_params": local, "steps": step - start_step, "first_loss": first_loss,
        "train_loss": float(loss.detach()) * args.accumulate, "val_loss": evaluate(model, val, args, device),
        "steps_per_s": (step - start_step) / seconds if seconds else 0.0,
        "bytes_per_step": sent / max(1, step - start_step),
        "hsdp_fp32_bytes_per_step": wire.allreduce_bytes(4 * local, mesh["replicate"].size()),
        "fsdp_shard": cfg.fsdp_shard, "fsdp_reduce_scatter": cfg.fsdp_reduce_scatter,
        "node_bytes_per_step": sum(log.node_bytes_sent for log in sync.traffic_logs()) / max(1, step - start_step),
        "optimizer_state_bytes": state,
        "replicas_identical": replicas_identical(model),
    }
    if rank == 0:
        report(summary)
        if args.out:
            Path(args.out).write_text(json.dumps(summary, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return summary


@torch.no_grad()
def replicas_identical(model) -> bool:
    """Whether every node holds the same model: the full parameters (each node all-gathers its
    shards) compared across every rank."""
    full = torch.cat([p.full_tensor().reshape(-1).float().cpu() for p in model.parameters()])
    every = [torch.empty_like(full) for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, full)
    return all(torch.equal(every[0], e) for e in every)


def save(directory: str, model, opt, schedule, sync, step: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, [opt])
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    entry = lowbit_strategy.save_rank_states(sync, directory)  # every rank's own state, a file each
    if dist.get_rank() == 0:
        torch.save({"lowbit": entry, "schedule": schedule.state_dict(), "step": step}, Path(directory) / "loop.pt")
    dist.barrier()


def load(directory: str, model, opt, schedule, sync) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, [opt])
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    set_state_dict(model, [opt], model_state_dict=model_sd, optim_state_dict=optim_sd)
    loop = torch.load(Path(directory) / "loop.pt", weights_only=False)
    lowbit_strategy.load_rank_states(sync, loop["lowbit"], directory)  # after DCP: each rank's own wins
    schedule.load_state_dict(loop["schedule"])
    return int(loop["step"])


@torch.no_grad()
def evaluate(model, val, args, device) -> float:
    model.eval()
    total, n = torch.zeros(()), 0
    for i, (x, y) in enumerate(val):
        if i >= args.val_batches:
            break
        if device is not None:
            x, y = x.to(device), y.to(device)
        total += F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten()).cpu()
        n += 1
    for unit in model.modules():  # a forward without backward leaves the root unsharded: shard it again
        if hasattr(unit, "reshard"):
            unit.reshard()
    model.train()
    return float(total / max(1, n))


def report(s: dict) -> None:
    across = (
        f"  across nodes: {s['bytes_per_step'] / 1e3:.1f} kB/step per rank, HSDP's fp32 all-reduce of the same "
        f"shards {s['hsdp_fp32_bytes_per_step'] / 1e3:.1f} kB "
        f"({s['hsdp_fp32_bytes_per_step'] / max(1.0, s['bytes_per_step']):.1f}x fewer bytes)\n"
    )
    if s["fsdp_shard"] == "world":  # one FSDP group: the reduce-scatter is what crosses nodes
        across = (
            f"  reduce-scatter {s['fsdp_reduce_scatter']}: {s['bytes_per_step'] / 1e3:.1f} kB/step per rank on the "
            f"network, {s['node_bytes_per_step'] / 1e3:.1f} kB inside the node\n"
        )
    print(
        f"{s['algorithm']} sharded over {s['nodes']} node(s) x {s['ranks_per_node']} rank(s): "
        f"{s['params'] / 1e6:.2f}M parameters, {s['local_params'] / 1e6:.2f}M on each rank\n"
        f"  loss {s['first_loss']:.3f} -> {s['train_loss']:.3f} (validation {s['val_loss']:.3f}), "
        f"{s['steps_per_s']:.2f} steps/s\n"
        f"{across}"
        f"  optimizer state per rank: {s['optimizer_state_bytes'] / 1e6:.2f} MB; "
        f"replicas identical across nodes: {s['replicas_identical']}",
        flush=True,
    )


if __name__ == "__main__":
    main()  # (barrier and destroy_process_group at its end: every rank is done)
