"""Cross-node bytes of the sharded path equal the cost model's, step by step: 2 emulated nodes x
2 ranks on gloo (the setup of ``test_sharded.py``), every sharded algorithm in each of its
modes or forms, and HSDP's fp32 and bf16 all-reduce hooks (``benchmarks.nodes.sharded_worker``),
a few steps each (warm-up and compressed stages). What each rank's ``sync.traffic_logs()``
records as network traffic during a step equals, exactly, what
:mod:`lowbit_strategy.pricing.sharded` (through :mod:`benchmarks.nodes.sharded_cost`)
predicts for its local rank; summed over a node's ranks, its link's bytes.

One FSDP group over all four ranks (``fsdp_shard="world"``, BitDP + AdamW, the benchmark's
``fsdp_*`` rows): FSDP's own all-gathers and exact reduce-scatter (logged by the benchmark's
recorder) and the quantized reduce-scatter, one hop and two, equal
:mod:`lowbit_strategy.pricing.world`'s bytes as gloo sends them, step by step.

The model has a parameter of one row (the last linear), so the second local rank holds an
empty shard of it (left out of its buckets, padded in FSDP's reduce-scatter output), and a
5-row one (shards of 3 and 2 rows, one padding row)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lowbit_strategy
from benchmarks.nodes import sharded_cost
from lowbit_strategy import LowBitConfig, buckets
from lowbit_strategy.collectives import wire
from tests.distributed import run_ranks
from tests.training import batch

PER_NODE, STEPS, WARMUP, BLOCK, BUCKET_MB = 2, 4, 2, 16, 0.0005


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 5),
                         nn.ReLU(), nn.Linear(5, 1))


def _loss(net, rank, step):
    x, y = batch(rank, step)
    return (net(x).squeeze(-1) - y.float()).pow(2).mean()


def lion_section(**kw):
    return ("lion", dict(algorithm="lion", warmup_steps=1, **kw), lambda ps: lowbit_strategy.Lion(ps, lr=1e-2))


def _turboquant(form):
    return ("turboquant", dict(algorithm="turboquant", turboquant_form=form, turboquant_block=BLOCK),
            lambda ps: lowbit_strategy.TurboQuantAdamW(ps, lr=1e-2, warmup_steps=WARMUP))


#: name -> (kind of benchmarks.nodes.sharded_cost, LowBitConfig fields or None (HSDP), optimizer factory)
CASES = {
    "hsdp_fp32": ("hsdp_fp32", None, lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
    "hsdp_bf16": ("hsdp_bf16", None, lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
    "lion_1bit": lion_section(mode="1bit"),
    "lion_1bit_at_step": lion_section(mode="1bit", overlap=False),
    "lion_sign": lion_section(mode="sign"),
    "lion_lp8_momentum_sync": lion_section(mode="lp", bits=8, momentum_sync_every=2, momentum_sync_layers="all"),
    "lion_fp32": lion_section(mode="fp32"),
    "lion_bf16": lion_section(mode="bf16"),
    "lion_auto": lion_section(mode="auto"),
    "onebit_adam_blocks": ("onebit_adam", dict(algorithm="onebit_adam", scale_block=BLOCK),
                           lambda ps: lowbit_strategy.OneBitAdam(ps, lr=1e-2, freeze_step=WARMUP)),
    "onebit_adam_one_scale": ("onebit_adam", dict(algorithm="onebit_adam", scale_block=None),
                              lambda ps: lowbit_strategy.OneBitAdam(ps, lr=1e-2, freeze_step=WARMUP)),
    "turboquant_allgather": _turboquant("allgather"),
    "turboquant_two_stage": _turboquant("two_stage"),
    "turboquant_fp32": _turboquant("fp32"),
}


def _setup(kind, fields, make_opt, mesh):
    from torch.distributed.fsdp import fully_shard

    from benchmarks.nodes.sharded_worker import hsdp_hooks

    net = _model()
    for i in (0, 2, 4, 6):
        fully_shard(net[i], mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    opt = make_opt(net.parameters())
    if fields is None:
        log = wire.TrafficLog()
        hsdp_hooks(net, mesh, torch.bfloat16 if kind == "hsdp_bf16" else torch.float32, log)
        return net, opt, None, [log]
    cfg = LowBitConfig(**fields, ranks_per_node=PER_NODE, bucket_size_mb=BUCKET_MB)
    sync = lowbit_strategy.attach_sharded(net, [opt], cfg, mesh=mesh)
    return net, opt, cfg, sync.traffic_logs()


def _expected(kind, cfg, opt, net, step, nodes):
    """The cost model's bytes of ``step`` for every local rank (and the node)."""
    model = sharded_cost.ShardedModel.of(net)
    kw: dict = {"bucket_numel": buckets.bucket_numel(BUCKET_MB)}
    if kind == "lion":
        kw["warmup"] = step <= cfg.warmup_steps
        kw["collective"] = sharded_cost.lion_collective(opt.communicator.plan)
        kw["overlap"] = cfg.lion.overlap  # launched per FSDP unit during backward, or at the step
        every = cfg.lion.momentum_sync_every
        if every and step % every == 0:
            kw["momentum_shapes"] = model.shapes  # momentum_sync_layers="all"
    elif kind in ("onebit_adam", "turboquant"):
        kw["warmup"] = step <= WARMUP
        kw["block"] = BLOCK if kind == "turboquant" else cfg.onebit_adam.scale_block
        if kind == "turboquant":
            kw["collective"] = {"allgather": "turboquant_allgather", "two_stage": "turboquant_two_stage",
                                "bf16": "bf16", "fp32": "fp32"}[cfg.turboquant.form]
    return sharded_cost.step_sends(kind, model, nodes, PER_NODE, **kw)


def _check(rank, world_size):
    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=PER_NODE))
    nodes, local = world_size // PER_NODE, rank % PER_NODE
    for name, (kind, fields, make_opt) in CASES.items():
        net, opt, cfg, logs = _setup(kind, fields, make_opt, mesh)
        for step in range(1, STEPS + 1):
            before = sum(log.bytes_sent for log in logs)
            opt.zero_grad()
            _loss(net, rank, step).backward()
            opt.step()
            got = sum(log.bytes_sent for log in logs) - before
            want = _expected(kind, cfg, opt, net, step, nodes)
            assert got == want.network[local], f"{name} step {step} rank {rank}: logged {got}, model {want.network}"
            every = torch.zeros(world_size, dtype=torch.int64)
            every[rank] = got
            dist.all_reduce(every)
            per_node = every.view(nodes, PER_NODE).sum(1).tolist()
            assert per_node == [want.network_per_node] * nodes, (name, step, per_node, want.network_per_node)
        if kind == "lion":  # the modes really differ (the formula is not checked against itself only)
            mode = opt.communicator.plan.mode
            assert mode == (fields["mode"] if fields["mode"] != "auto" else mode), name
        if kind in ("onebit_adam", "turboquant") and not (kind == "turboquant" and cfg.turboquant.form == "fp32"):
            assert opt.communicator.errors, f"{name}: no compressed step ran"


@pytest.mark.slow
def test_cross_node_bytes_equal_the_cost_model_for_the_sharded_layout():
    run_ranks(2 * PER_NODE, _check)


#: name -> (fsdp_reduce_scatter, topology)
WORLD_CASES = {"fp32": ("fp32", "flat"), "int8": ("int8", "flat"), "int4_two_hops": ("int4", "auto"),
               "int2_two_hops": ("int2", "auto")}


def _check_world(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    from benchmarks.nodes.sharded_worker import record_fsdp_calls
    from lowbit_strategy.pricing.world import world_sends

    mesh = lowbit_strategy.world_mesh("cpu")
    for name, (rs, topology) in WORLD_CASES.items():
        net = _model()
        for i in (0, 2, 4, 6):
            fully_shard(net[i], mesh=mesh["shard"])
        fully_shard(net, mesh=mesh["shard"])
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
        cfg = LowBitConfig(algorithm="bitdp", fsdp_shard="world", fsdp_reduce_scatter=rs, topology=topology,
                           ranks_per_node=PER_NODE)
        sync = lowbit_strategy.attach_sharded(net, [opt], cfg, mesh=mesh)
        fsdp_log = wire.TrafficLog()
        record_fsdp_calls(net, fsdp_log, reduce_scatter=rs == "fp32")
        logs = [*sync.traffic_logs(), fsdp_log]
        want = world_sends(sharded_cost.ShardedModel.of(net).units, world_size // PER_NODE, PER_NODE,
                           reduce_scatter=rs, two_hop=topology != "flat", impl="gloo")
        for step in range(1, 3):
            before = [(log.bytes_sent, log.node_bytes_sent) for log in logs]
            opt.zero_grad()
            _loss(net, rank, step).backward()
            opt.step()
            sent = sum(log.bytes_sent - b for log, (b, _) in zip(logs, before))
            node = sum(log.node_bytes_sent - b for log, (_, b) in zip(logs, before))
            assert (sent, node) == (want.logged, want.total.node), f"{name} step {step} rank {rank}: {sent, node}"


@pytest.mark.slow
def test_world_fsdp_bytes_equal_the_cost_model():
    run_ranks(2 * PER_NODE, _check_world)
