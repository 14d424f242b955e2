"""One rank of :mod:`benchmarks.nodes.sharded`: the GPT of :mod:`benchmarks.e2e.worker`
(``examples/gpt_lion.py``'s model, data and optimizers) sharded with FSDP2 inside each node
and synchronized across nodes by one configuration (:data:`CONFIGS`), trained for a
wall-clock budget with a plain torch loop; rank 0 writes one JSON record.

**Launch**: by :class:`benchmarks.harness.netem.Network` in the node form (``MASTER_ADDR``,
``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` ... set), or by ``torchrun`` for a try without
namespaces (no link counters then). The mesh is :func:`lowbit_strategy.node_mesh`'s; each
block is ``fully_shard``-ed over ``mesh["shard"]``, then the root.

**Configurations**: ``hsdp_fp32`` / ``hsdp_bf16`` (what HSDP does: FSDP2 inside the node and
an all-reduce of every unit's gradient shard across nodes, from the unit's all-reduce hook
over ``mesh["replicate"]``, divided by N; :func:`hsdp_hooks`), with AdamW; the sharded
algorithms through :func:`lowbit_strategy.attach_sharded`: Lion Cub 1-bit and ``auto``,
1-bit Adam, TurboQuant-Adam (its ``auto`` form). ``fsdp_*`` (kind ``fsdp_world``): one FSDP
group over every rank (:func:`lowbit_strategy.world_mesh`, ``fsdp_shard="world"``), BitDP
at one "node" with AdamW (exactly FSDP + AdamW), its reduce-scatter FSDP's own (``fsdp_fp32``)
or quantized, one hop (``topology="flat"``) or two (``fsdp_int4_2hop``); FSDP's own
all-gathers and exact reduce-scatter are recorded by :func:`record_fsdp_calls`, so the logs
hold every byte these rows send.

**Measured** over the steady-state window (after step ``--warm`` to the last step, past the
staged optimizers' warm-up), as :mod:`benchmarks.e2e.worker` does: step time (rank 0's
clock; the ranks run in lock-step: a 4-byte broadcast of the budget flag every step), each
node's link counters (:func:`benchmarks.harness.netem.rank_counters`), the network bytes each rank's
traffic logs recorded, and at the end each rank's state bytes (its optimizer state and the
communicator's error buffers, local tensors) and the cost model's bytes per step
(:mod:`benchmarks.nodes.sharded_cost`). At the end, a validation loss on the held-out 10 % of the
data (``--val-batches`` batches per rank, every rank the same count: FSDP's collectives).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import lowbit_strategy  # noqa: E402
from benchmarks.nodes import sharded_cost  # noqa: E402
from benchmarks.harness.leave import leave  # noqa: E402
from lowbit_strategy import LowBitConfig  # noqa: E402
from lowbit_strategy.collectives import group as g  # noqa: E402
from lowbit_strategy.collectives import wire  # noqa: E402
from lowbit_strategy.integrations.sharded import sharded_units  # noqa: E402

#: name -> (kind of :mod:`benchmarks.nodes.sharded_cost`, optimizer of examples.causal_lm, LowBitConfig fields)
CONFIGS: dict[str, tuple[str, str, dict]] = {
    "hsdp_fp32": ("hsdp_fp32", "adamw", {}),
    "hsdp_bf16": ("hsdp_bf16", "adamw", {}),
    "lion_1bit": ("lion", "lion", {"algorithm": "lion", "mode": "1bit"}),
    "lion_auto": ("lion", "lion", {"algorithm": "lion", "mode": "auto"}),
    "onebit_adam": ("onebit_adam", "onebit_adam", {"algorithm": "onebit_adam"}),
    # 1-bit LAMB sends what 1-bit Adam sends (the same compensated allreduce): its cost is 1-bit Adam's
    "onebit_lamb": ("onebit_adam", "onebit_lamb", {"algorithm": "onebit_lamb"}),
    "turboquant": ("turboquant", "turboquant", {"algorithm": "turboquant"}),
    # the same with the exchange in optimizer.step() (the section's overlap off): the form before
    # the exchange started during backward, side by side with it
    "lion_1bit_step": ("lion", "lion", {"algorithm": "lion", "mode": "1bit", "overlap": False}),
    "onebit_adam_step": ("onebit_adam", "onebit_adam", {"algorithm": "onebit_adam", "overlap": False}),
    "turboquant_step": ("turboquant", "turboquant", {"algorithm": "turboquant", "overlap": False}),
    # the comm-free bound: FSDP2 inside each node and nothing across nodes (not a method: the
    # nodes' replicas drift apart), the same computation as every row
    "node_only": ("node_only", "adamw", {}),
    **{f"fsdp_{name}": ("fsdp_world", "adamw", {"algorithm": "bitdp", "fsdp_shard": "world",
                                                "fsdp_reduce_scatter": rs, "topology": topology})
       for name, rs, topology in (("fp32", "fp32", "flat"), ("int8", "int8", "flat"), ("int4", "int4", "flat"),
                                  ("int4_2hop", "int4", "auto"))},
}


def record_fsdp_calls(model: torch.nn.Module, traffic: wire.TrafficLog, reduce_scatter: bool) -> None:
    """Record FSDP's own collectives of every unit in ``traffic`` (network scope: the group is
    the world), as one rank sends them on gloo: the all-gather's ring ``(W-1)·input bytes``
    and, when ``reduce_scatter``, the exact reduce-scatter's, which gloo runs as an allreduce of
    the whole input (``ar(input bytes)``; :mod:`lowbit_strategy.pricing.world`).
    Subclasses of FSDP's default calls, so FSDP treats them as its own."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

    def add(op: str, nbytes: int, group) -> None:
        wire.record(wire.TrafficRecord(op, nbytes, nbytes, dist.get_world_size(group)), traffic)

    class Gather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            w = dist.get_world_size(group)
            add("fsdp.all_gather", wire.all_gather_bytes(input_tensor.numel() * input_tensor.element_size(), w), group)
            return super().__call__(output_tensor, input_tensor, group, async_op)

    class Scatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            w = dist.get_world_size(group)
            add("fsdp.reduce_scatter", wire.allreduce_bytes(input_tensor.numel() * input_tensor.element_size(), w),
                group)
            return super().__call__(output_tensor, input_tensor, group, op, async_op)

    for unit, params in sharded_units(model):
        if params:
            unit.set_custom_all_gather(Gather())  # type: ignore[operator]
            if reduce_scatter:
                unit.set_custom_reduce_scatter(Scatter())  # type: ignore[operator]


def hsdp_hooks(model: torch.nn.Module, mesh, dtype: torch.dtype, traffic: wire.TrafficLog) -> None:
    """HSDP's cross-node step on a model ``fully_shard``-ed over ``mesh["shard"]``: every
    unit's all-reduce hook replaces its gradient shard (the node's mean) by its mean over
    the N nodes (``mesh["replicate"]``), sent as ``dtype`` (divided by N first, as DDP's
    hooks do, then summed), recorded in ``traffic``."""
    group = mesh["replicate"].get_group()
    nodes = mesh["replicate"].size()
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]

    def hook(reduce_output: torch.Tensor) -> None:
        if dtype == reduce_output.dtype:
            reduce_output.div_(nodes)
            g.all_reduce_sum(reduce_output, group, f"hsdp.allreduce.{name}", traffic)
            return
        buf = reduce_output.div(nodes).to(dtype)
        g.all_reduce_sum(buf, group, f"hsdp.allreduce.{name}", traffic)
        reduce_output.copy_(buf)

    for unit, params in sharded_units(model):
        if params:
            unit.set_all_reduce_hook(hook)  # type: ignore[operator]


def state_bytes(opt: torch.optim.Optimizer) -> dict[str, int]:
    """This rank's optimizer state and communicator error buffers, in bytes of local tensors."""
    optim = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                v = v.to_local() if hasattr(v, "to_local") else v
                optim += v.numel() * v.element_size()
    errors = 0
    for st in getattr(getattr(opt, "communicator", None), "errors", {}).values():
        errors += sum(t.numel() * t.element_size() for t in st.tensors())
    return {"optimizer": optim, "errors": errors, "total": optim + errors}


def expected(kind: str, opt, cfg: LowBitConfig | None, model: torch.nn.Module, nodes: int, per_node: int) -> dict:
    """The cost model's bytes of one steady-state step on ``nodes`` x ``per_node`` ranks: what
    each local rank's logs record as network traffic, the sum over a node's ranks, and what
    crosses a node's link (the same in the sharded layout, where every logged byte crosses)."""
    from lowbit_strategy import buckets
    from lowbit_strategy.pricing.sharded import TURBOQUANT

    if kind == "node_only":
        return {"per_local_rank": [0] * per_node, "per_node": 0, "logged_per_node": 0}
    shape = sharded_cost.ShardedModel.of(model, [p for grp in opt.param_groups for p in grp["params"]])
    if kind == "fsdp_world" and cfg is not None:
        from lowbit_strategy.pricing.world import world_sends

        world = world_sends(shape.units, nodes, per_node, reduce_scatter=cfg.fsdp_reduce_scatter,
                            two_hop=cfg.topology != "flat", impl="gloo")  # auto: hierarchical at >= 2 x 2
        return {"per_local_rank": [world.logged] * per_node, "per_node": world.link,
                "logged_per_node": world.logged * per_node}
    kw: dict = {}
    comm = getattr(opt, "communicator", None)
    if cfg is not None:
        kw["bucket_numel"] = buckets.bucket_numel(cfg.bucket_size_mb)
    if kind == "lion" and comm is not None and comm.plan is not None:
        kw["collective"] = sharded_cost.lion_collective(comm.plan)
        kw["overlap"] = cfg is not None and cfg.lion.overlap
    elif kind == "onebit_adam" and cfg is not None:
        kw["block"] = cfg.section.scale_block
    elif kind == "turboquant" and comm is not None:
        from lowbit_strategy.algorithms.turboquant.form import choose_form

        def form(n: int) -> str:
            return TURBOQUANT[choose_form(comm.form, comm.world_size, n, *comm.link, comm.codec_seconds,
                                          comm.fallback)]

        kw.update(collective=form, block=comm.codec.block, bits=opt.bits)
    sends = sharded_cost.step_sends(kind, shape, nodes, per_node, **kw)
    return {"per_local_rank": list(sends.network), "per_node": sends.network_per_node,
            "logged_per_node": sends.network_per_node}


def world_plan(cfg) -> str:
    """The reduce-scatter a ``fsdp_world`` configuration runs, in words."""
    if cfg.fsdp_reduce_scatter == "fp32":
        return "RS fp32 (gloo: allreduce)"
    return f"RS {cfg.fsdp_reduce_scatter}, {'one hop' if cfg.topology == 'flat' else 'two hops'}"


@torch.no_grad()
def validation_loss(model: torch.nn.Module, held_out, args, rank: int, world: int) -> float:
    """Mean loss over the first ``args.val_batches`` batches of each rank's part of the held-out
    windows, averaged over ranks (every rank runs the same number of forwards)."""
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(held_out, num_replicas=world, rank=rank, shuffle=False)
    total, count = torch.zeros(2, dtype=torch.float64), 0
    for x, y in DataLoader(held_out, batch_size=args.batch, sampler=sampler, drop_last=True):
        if count == args.val_batches:
            break
        total[0] += float(model._loss((x, y)))
        count += 1
    total[1] = count
    dist.all_reduce(total)
    return float(total[0] / total[1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, choices=sorted(CONFIGS))
    ap.add_argument("--budget", type=float, required=True, help="training seconds")
    ap.add_argument("--out", required=True, help="JSON file rank 0 writes")
    ap.add_argument("--warm", type=int, default=40, help="steps before the steady-state window")
    ap.add_argument("--freeze-step", type=int, default=30, help="1-bit Adam freeze step, TurboQuant warm-up")
    ap.add_argument("--model", choices=("gpt", "mlp"), default="gpt",
                    help="the e2e GPT, or benchmarks.nodes.sharded_mlp's MLP (--d-model wide, --layers blocks)")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="per rank")
    ap.add_argument("--lr-lion", type=float, default=1e-3)
    ap.add_argument("--lr-adamw", type=float, default=3e-3)
    ap.add_argument("--data-mb", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--val-batches", type=int, default=8, help="validation batches per rank at the end")
    ap.add_argument("--timeout", type=float, default=300, help="process-group timeout (s)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # 4 ranks share this machine's cores
    torch.set_num_interop_threads(1)
    warnings.filterwarnings("ignore")
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, DistributedSampler

    from benchmarks.harness.netem import Counters, rank_counters
    from examples.gpt_lion import GPT, Windows, stdlib_bytes

    kind, optimizer, fields = CONFIGS[args.config]
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    counters = rank_counters if "LBS_NETNS" in os.environ else Counters
    world_group = kind == "fsdp_world"
    mesh = lowbit_strategy.world_mesh("cpu") if world_group else lowbit_strategy.node_mesh("cpu")
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", mesh["shard"].size()))  # the machines, not the mesh
    nodes = world // per_node

    lr = args.lr_lion if optimizer == "lion" else args.lr_adamw
    if args.model == "mlp":
        from benchmarks.nodes.sharded_mlp import MLP, datasets

        # 50 steps an epoch: its held-out tenth gives each rank 5 validation batches
        data, held_out = datasets(args.d_model, 50 * args.batch * world, args.seed)
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = MLP(args.d_model, args.layers, lr=lr, optimizer=optimizer, freeze_step=args.freeze_step)
    else:
        tokens = stdlib_bytes(int(args.data_mb * 2**20))
        split = int(len(tokens) * 0.9)
        data, held_out = Windows(tokens[:split], args.seq), Windows(tokens[split:], args.seq)
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = GPT(seq=args.seq, d=args.d_model, layers=args.layers, heads=args.heads, lr=lr, optimizer=optimizer,
                    freeze_step=args.freeze_step, warmup=20, total_steps=2000)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    setup = model.configure_optimizers()  # examples.causal_lm: the optimizer and its LR schedule
    opt, sched = setup["optimizer"], setup["lr_scheduler"]["scheduler"]
    cfg = None
    harness_log = wire.TrafficLog()  # what the harness itself records: HSDP's hooks, FSDP's own calls
    if kind.startswith("hsdp"):
        hsdp_hooks(model, mesh, torch.bfloat16 if kind == "hsdp_bf16" else torch.float32, harness_log)
        logs = [harness_log]
    elif kind == "node_only":  # FSDP2's node reduce-scatter and all-gather only
        logs = [harness_log]
    else:
        link_bps = float(os.environ.get("LBS_LINK_BPS", "0"))
        extra = {"link_bandwidth_gbps": link_bps / 1e9} if link_bps else {}
        cfg = LowBitConfig(**fields, ranks_per_node=per_node, **extra)
        sync = lowbit_strategy.attach_sharded(model, [opt], cfg, mesh=mesh)
        logs = sync.traffic_logs()
        if world_group:  # FSDP's own calls cross nodes too: log them beside the quantized reduce-scatter's
            record_fsdp_calls(model, harness_log, reduce_scatter=cfg.fsdp_reduce_scatter == "fp32")
            logs = [*logs, harness_log]

    def logged() -> int:
        return sum(log.bytes_sent for log in logs)

    flag = torch.zeros(1, dtype=torch.int32)
    losses: list[float] = []
    marks: dict[str, tuple] = {}
    dist.barrier()
    t0 = last_print = time.perf_counter()
    step = 0
    while not flag.item():
        sampler.set_epoch(step)
        for x, y in loader:
            step += 1
            opt.zero_grad()
            loss = model._loss((x, y))
            loss.backward()
            opt.step()
            sched.step()
            losses.append(float(loss))
            now = time.perf_counter()
            if rank == 0:
                flag.fill_(int(now - t0 >= args.budget))
                if now - last_print >= 10:
                    last_print = now
                    print(f"  step {step:5d}  {now - t0:6.1f}s  loss {losses[-1]:.3f}", flush=True)
            dist.broadcast(flag, src=0)
            if step == args.warm:  # counters, then every rank at the window's start, then the clock
                c = counters()
                dist.barrier()
                marks["start"] = (step, time.perf_counter(), c, logged(), time.process_time())
            if flag.item():  # the clock on the window's side, then the counters
                marks["end"] = (step, time.perf_counter(), counters(), logged(), time.process_time())
                break
    if "start" not in marks:
        raise SystemExit(f"only {step} steps in {args.budget:g} s: lower --warm (now {args.warm}) or raise --budget")
    val_loss = validation_loss(model, held_out, args, rank, world)
    start, end = marks["start"], marks["end"]
    n = max(1, end[0] - start[0])
    delta = end[2] - start[2]
    mine = [n, end[1] - start[1], delta.wire_tx / n, delta.wire_rx / n, (end[3] - start[3]) / n,
            (end[4] - start[4]) / n, *state_bytes(opt).values(), sum(losses[-20:]) / max(1, len(losses[-20:]))]
    every = [torch.empty(len(mine), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(every, torch.tensor(mine, dtype=torch.float64))
    want = expected(kind, opt, cfg, model, nodes, per_node)
    if rank == 0:
        keys = ("window_steps", "window_s", "wire_tx", "wire_rx", "logged_sent", "cpu_s", "state_optimizer",
                "state_errors", "state_total", "loss")
        per_rank = [dict(zip(keys, t.tolist())) for t in every]
        comm = getattr(opt, "communicator", None)
        plan = getattr(comm, "plan", None)
        forms = sorted(set(getattr(comm, "forms", {}).values()))
        rec = {
            "config": args.config, "kind": kind, "optimizer": optimizer, "lr": lr, "P": world,
            "nodes": nodes, "ranks_per_node": per_node, "link": os.environ.get("LBS_LINK", "?"),
            "params": sum(p.numel() for p in model.parameters()), "budget_s": args.budget, "steps": step,
            "window_first_step": start[0], "step_s": per_rank[0]["window_s"] / per_rank[0]["window_steps"],
            "cross_node_bytes_per_node_per_step": [max(r["wire_tx"], r["wire_rx"]) for r in per_rank[::per_node]],
            "logged_bytes_per_node_per_step": [sum(r["logged_sent"] for r in per_rank[k * per_node:(k + 1) * per_node])
                                               for k in range(nodes)],
            "model_bytes_per_local_rank": want["per_local_rank"], "model_bytes_per_node": want["per_node"],
            "model_logged_bytes_per_node": want["logged_per_node"], "val_loss": val_loss,
            "state_bytes_per_rank": [int(r["state_total"]) for r in per_rank],
            "state_optimizer_bytes_per_rank": [int(r["state_optimizer"]) for r in per_rank],
            "state_error_bytes_per_rank": [int(r["state_errors"]) for r in per_rank],
            "loss_reached": sum(r["loss"] for r in per_rank) / world,
            "plan": (world_plan(cfg) if world_group else
                     f"{plan.mode}{plan.bits if plan.mode in ('lp', 'sign') else ''}" if plan else
                     "/".join(forms) if forms else
                     f"1-bit, scale block {cfg.section.scale_block}" if cfg and kind == "onebit_adam" else None),
            "per_rank": per_rank,
        }
        Path(args.out).write_text(json.dumps(rec) + "\n")
        print(f"  done: {step} steps, {rec['step_s'] * 1e3:.1f} ms/step, cross-node "
              f"{'/'.join(f'{b / 1e3:.1f}' for b in rec['cross_node_bytes_per_node_per_step'])} kB/step per node, "
              f"logged {'/'.join(f'{b / 1e3:.1f}' for b in rec['logged_bytes_per_node_per_step'])} kB, "
              f"model {want['per_node'] / 1e3:.1f} kB, loss {rec['loss_reached']:.3f}, val {val_loss:.3f}",
              flush=True)
    return 0  # the group is destroyed by leave(), once this frame is gone


if __name__ == "__main__":
    leave(main())
