"""The sharded path (FSDP2 inside each node, the algorithm across nodes) at 2 emulated nodes
x 2 ranks on gloo, against its oracle: the flat algorithm run by N = 2 workers, each fed its
node's mean gradient, in the sharded layout.

The oracle uses no FSDP: every rank keeps a plain replica of the model; each step it
computes its own gradient, averages it over its node (an allreduce of the halves: exact for
two ranks), cuts this local rank's dim-0 rows of every parameter (FSDP2's shard: ceil(d0/L)
rows per rank, the last ones shorter or empty), steps the flat algorithm on those row blocks
over the cross-node group of its local rank (``lowbit_strategy`` with ``topology='flat'`` on
that group; during a staged optimizer's warm-up its gradients are first averaged over the
nodes, as DDP's hook would), and all-gathers the node's row blocks back into the replica.
"""
from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

import lowbit_strategy
from lowbit_strategy import LowBitConfig, LowBitSetupError
from lowbit_strategy.integrations.ddp import attach_optimizers, build_sync
from tests.collectives.test_scaling import _Bucket
from tests.distributed import run_ranks
from tests.training import loss, model, train

PER_NODE, STEPS = 2, 6

#: name -> (config keywords, optimizer factory, plain single-node reference optimizer factory)
CASES = {
    "lion_1bit": (dict(algorithm="lion", mode="1bit", warmup_steps=1),
                  lambda ps: lowbit_strategy.Lion(ps, lr=1e-2, weight_decay=0.1), None),
    "lion_lp": (dict(algorithm="lion", mode="lp", bits=8, p=1.0, warmup_steps=1, momentum_sync_every=3),
                lambda ps: lowbit_strategy.Lion(ps, lr=1e-2), None),
    "lion_sign": (dict(algorithm="lion", mode="sign", bits=4, warmup_steps=1),
                  lambda ps: lowbit_strategy.Lion(ps, lr=1e-2), None),
    "onebit_adam": (dict(algorithm="onebit_adam", bucket_size_mb=0.0005, scale_block=16),
                    lambda ps: lowbit_strategy.OneBitAdam(ps, lr=1e-2, freeze_step=2), None),
    "turboquant": (dict(algorithm="turboquant", bucket_size_mb=0.0005, turboquant_form="two_stage",
                        turboquant_block=16),
                   lambda ps: lowbit_strategy.TurboQuantAdamW(ps, lr=1e-2, warmup_steps=2, scale_decay=0.9),
                   lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)),
    # each rank's shards with their counterparts on the other node: 1-bit values, the update a step late
    "demo": (dict(algorithm="demo", values="sign", delay=1),
             lambda ps: lowbit_strategy.DeMo(ps, lr=1e-2, compression_topk=3, compression_chunk=4, weight_decay=0.1),
             lambda ps: _lone_demo(ps)),
}


def _lone_demo(params):
    """DeMo with the sharded case's codec and delay over one worker (one node: nothing to exchange)."""
    from lowbit_strategy.algorithms.demo.exchange import Exchange

    opt = lowbit_strategy.DeMo(params, lr=1e-2, compression_topk=3, compression_chunk=4, weight_decay=0.1)
    opt.attach_exchange(Exchange("sign"), delay=1)
    return opt


def _rows(d0: int, local: int) -> tuple[int, int]:
    """FSDP2's dim-0 shard of local rank ``local``: rows [lo, hi)."""
    c = -(-d0 // PER_NODE)
    return min(d0, local * c), min(d0, (local + 1) * c)


def _sharded_model(mesh, bf16: bool = False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) if bf16 else {}
    net = model()
    for i in (0, 2, 4):  # the embedding and both linears are units; the root has no parameters
        fully_shard(net[i], mesh=mesh["shard"], **kw)
    fully_shard(net, mesh=mesh["shard"], **kw)
    return net


def _backward(net, rank, step, micro: int, bf16: bool = False) -> None:
    """``micro`` micro-batches (step's data, then step + 100's, ...): gradients accumulate
    and only the last one synchronizes (FSDP2's ``set_requires_gradient_sync``)."""
    for i in range(micro):
        if hasattr(net, "set_requires_gradient_sync"):
            net.set_requires_gradient_sync(i == micro - 1)
        loss(net, rank, step + 100 * i).backward()


def _full(net) -> list[torch.Tensor]:
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in net.parameters()]


@torch.no_grad()
def _rows_back(replica, shards, intra) -> None:
    """The node's row blocks of every parameter all-gathered back into the replica."""
    for p, s in zip(replica.parameters(), shards):
        c = -(-p.shape[0] // PER_NODE)
        block = torch.zeros((c, *p.shape[1:]))
        block[: s.shape[0]] = s
        every = [torch.empty_like(block) for _ in range(PER_NODE)]
        dist.all_gather(every, block, group=intra)
        p.copy_(torch.cat(every)[: p.shape[0]])


def _oracle(rank, cfg, make_opt, steps, warmup, groups, micro=1, bf16=False):
    intra, inter = groups
    local = rank % PER_NODE
    replica = model()
    shard_model = model()  # the same modules (parameter roles and names), holding this rank's rows
    for p in shard_model.parameters():
        p.data = p.data[slice(*_rows(p.shape[0], local))].clone()
    shards = list(shard_model.parameters())
    opt = make_opt(shards)
    overlap = {"overlap": False} if "overlap" in LowBitConfig(**cfg).section.fields() else {}
    sync = build_sync(LowBitConfig(**cfg, topology="flat", **overlap), shard_model, inter)
    attach_optimizers(sync, [opt])
    for step in range(1, steps + 1):
        replica.zero_grad()
        computed = replica
        if bf16:  # what FSDP computes with: the parameters cast to bf16; gradients reduced in fp32
            computed = model().to(torch.bfloat16)
            with torch.no_grad():
                for c, p in zip(computed.parameters(), replica.parameters()):
                    c.copy_(p)
        _backward(computed, rank, step, micro)
        for p, c, s in zip(replica.parameters(), computed.parameters(), shards):
            g = c.grad.float().mul(0.5)
            dist.all_reduce(g, group=intra)  # the node's mean (two halves: exact)
            s.grad = g[slice(*_rows(p.shape[0], local))].clone()
            if step <= warmup:  # a staged optimizer's warm-up: DDP's mean over the nodes, as torch's
                # bf16_compress_hook computes it (LowBitConfig.warmup_wire's default)
                sent = s.grad.to(torch.bfloat16).div_(2)
                dist.all_reduce(sent, group=inter)
                s.grad.copy_(sent)
        opt.step()
        _rows_back(replica, shards, intra)
    return [p.detach() for p in replica.parameters()], opt


def _attached(cfg, make_opt, mesh, bf16=False, **overrides):
    """``(net, optimizer, sync)``: the sharded model, its optimizer, ``attach_sharded`` under ``cfg``."""
    net = _sharded_model(mesh, bf16)
    opt = make_opt(net.parameters())
    config = LowBitConfig(**cfg, ranks_per_node=PER_NODE, **overrides)
    return net, opt, lowbit_strategy.attach_sharded(net, [opt], config, mesh=mesh)


def _sharded(rank, cfg, make_opt, steps, mesh, micro=1, bf16=False):
    net, opt, sync = _attached(cfg, make_opt, mesh, bf16)
    for step in range(1, steps + 1):
        opt.zero_grad()
        _backward(net, rank, step, micro, bf16)
        opt.step()
    return net, opt, sync


def _state_bytes(opt) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                v = v.to_local() if hasattr(v, "to_local") else v
                total += v.numel() * v.element_size()
    comm = getattr(opt, "communicator", None)
    for st in getattr(comm, "errors", {}).values():
        total += sum(t.numel() * t.element_size() for t in st.tensors())
    return total


def _check_against_oracle(rank, world_size):
    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=PER_NODE))
    assert mesh.mesh_dim_names == ("replicate", "shard") and mesh["shard"].size() == PER_NODE
    groups = (mesh["shard"].get_group(), mesh["replicate"].get_group())
    for name, (cfg, make_opt, _) in CASES.items():
        warmup = 2 if cfg["algorithm"] in ("onebit_adam", "turboquant") else 0
        net, opt, sync = _sharded(rank, cfg, make_opt, STEPS, mesh)
        want, oracle_opt = _oracle(rank, cfg, make_opt, STEPS, warmup, groups)
        got = _full(net)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{name}: sharded != oracle on rank {rank}"
        # replicas identical across nodes (the gathered full parameters are equal everywhere)
        every = [torch.empty_like(torch.cat([t.reshape(-1) for t in got])) for _ in range(world_size)]
        dist.all_gather(every, torch.cat([t.reshape(-1) for t in got]))
        assert all(torch.equal(every[0], e) for e in every), name
        # the state of a rank is its shard's: about 1/L of the DDP form's (every rank holding
        # the whole model's optimizer state and error buffers; same data, same steps)
        _, ddp_opt, _ = train(rank, make_opt, LowBitConfig(**cfg, topology="flat"), STEPS)
        # (FSDP2 gives the first ranks ceil(d0/L) rows: on this small model's 5-row head rank 0
        # holds 51 % of the elements, so the bound is on the node's mean, the largest rank within 0.6)
        mine, ddp = _state_bytes(opt), _state_bytes(ddp_opt)
        mean = torch.tensor([float(mine)])
        dist.all_reduce(mean)
        assert 0 < mean.item() / world_size <= 0.55 * ddp and mine <= 0.6 * ddp, (name, mine, ddp)
        # cross-node bytes were counted, intra-node traffic is FSDP's (none of ours)
        logs = sync.traffic_logs()
        assert sum(log.bytes_sent for log in logs) > 0, name
        del oracle_opt


def _check_accumulation_and_mixed_precision(rank, world_size):
    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=PER_NODE))
    groups = (mesh["shard"].get_group(), mesh["replicate"].get_group())
    for name in ("lion_1bit", "onebit_adam"):
        cfg, make_opt, _ = CASES[name]
        warmup = 2 if cfg["algorithm"] == "onebit_adam" else 0
        for micro, bf16 in ((2, False), (1, True)):
            net, _, sync = _sharded(rank, cfg, make_opt, STEPS, mesh, micro=micro, bf16=bf16)
            want, _ = _oracle(rank, cfg, make_opt, STEPS, warmup, groups, micro=micro, bf16=bf16)
            assert all(torch.equal(a, b) for a, b in zip(_full(net), want)), f"{name} micro={micro} bf16={bf16}"
            if micro > 1:  # one exchange per optimizer step: the bytes of the run without accumulation
                _, _, once = _sharded(rank, cfg, make_opt, STEPS, mesh)
                sent = [sum(log.bytes_sent for log in s.traffic_logs()) for s in (sync, once)]
                assert sent[0] == sent[1] > 0, (name, sent)


@pytest.mark.slow
def test_accumulation_and_bf16_mixed_precision_equal_the_oracle():
    run_ranks(2 * PER_NODE, _check_accumulation_and_mixed_precision)


@pytest.mark.slow
def test_every_sharded_algorithm_equals_its_oracle_at_two_nodes_of_two():
    run_ranks(2 * PER_NODE, _check_against_oracle)


def _check_one_node(rank, world_size):
    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=world_size))
    for name, (cfg, make_opt, make_plain) in CASES.items():
        net, opt, sync = _sharded(rank, cfg, make_opt, STEPS, mesh)
        plain = _sharded_model(mesh)
        ref = (make_plain or make_opt)(plain.parameters())
        for step in range(1, STEPS + 1):
            ref.zero_grad()
            loss(plain, rank, step).backward()
            ref.step()
        assert all(torch.equal(a, b) for a, b in zip(_full(net), _full(plain))), f"{name}: one node"
        assert sum(log.bytes_sent for log in sync.traffic_logs()) == 0, name  # nothing crosses a network
    # BitDP under AdamW: nothing is quantized on one node
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=False)  # noqa: E731
    net, _, sync = _sharded(rank, dict(algorithm="bitdp", warmup_steps=0), adamw, STEPS, mesh)
    plain = _sharded_model(mesh)
    ref = adamw(plain.parameters())
    for step in range(1, STEPS + 1):
        ref.zero_grad()
        loss(plain, rank, step).backward()
        ref.step()
    assert all(torch.equal(a, b) for a, b in zip(_full(net), _full(plain))), "bitdp: one node"


@pytest.mark.slow
def test_one_node_equals_fsdp2_with_the_plain_optimizer():
    run_ranks(PER_NODE, _check_one_node)


def _check_bad_inputs(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=PER_NODE))
    cfg = LowBitConfig(algorithm="lion", ranks_per_node=PER_NODE)
    ddp = nn.parallel.DistributedDataParallel(model())
    with pytest.raises(LowBitSetupError, match="not a DistributedDataParallel model"):
        lowbit_strategy.attach_sharded(ddp, [lowbit_strategy.Lion(ddp.parameters())], cfg, mesh=mesh)
    with pytest.raises(LowBitSetupError, match="no fully_shard-ed module"):
        plain = model()
        lowbit_strategy.attach_sharded(plain, [lowbit_strategy.Lion(plain.parameters())], cfg, mesh=mesh)
    spanning = model()  # one FSDP group over all four ranks: every reduce-scatter crosses nodes
    flat_mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(spanning, mesh=flat_mesh)
    with pytest.raises(LowBitSetupError, match="not the mesh's FSDP group.*fsdp_shard='world'"):
        lowbit_strategy.attach_sharded(spanning, [lowbit_strategy.Lion(spanning.parameters())], cfg, mesh=mesh)
    with pytest.raises(LowBitSetupError, match="fsdp_shard='world' asks for one FSDP group over every rank"):
        lowbit_strategy.attach_sharded(spanning, [lowbit_strategy.Lion(spanning.parameters())],
                                       cfg.replace(fsdp_shard="world"), mesh=mesh)
    native = model()  # FSDP2's native HSDP: a 2-D mesh
    fully_shard(native, mesh=mesh)
    with pytest.raises(LowBitSetupError, match="native HSDP"):
        lowbit_strategy.attach_sharded(native, [lowbit_strategy.Lion(native.parameters())], cfg, mesh=mesh)
    net = _sharded_model(mesh)
    with pytest.raises(LowBitSetupError, match="drives lowbit_strategy.Lion"):
        lowbit_strategy.attach_sharded(net, [torch.optim.AdamW(net.parameters())], cfg, mesh=mesh)
    with pytest.raises(LowBitSetupError, match=r"drives lowbit_strategy\.OneBitLamb"):
        lowbit_strategy.attach_sharded(net, [lowbit_strategy.Lion(net.parameters())],
                                       LowBitConfig(algorithm="onebit_lamb", ranks_per_node=PER_NODE), mesh=mesh)


@pytest.mark.slow
def test_bad_inputs_raise_on_every_rank_naming_the_fix():
    run_ranks(2 * PER_NODE, _check_bad_inputs)


def _save(net, opt, sync, directory):
    """The sharded checkpoint: model and optimizer through torch.distributed.checkpoint with
    FSDP2's state-dict helpers, every rank's rank-local state in a file of its own beside it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(net, [opt])
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    entry = [lowbit_strategy.save_rank_states(sync, directory)]
    dist.broadcast_object_list(entry, src=0)  # rank 0 keeps the index (e.g. in its own small file)
    return entry[0]


def _load(net, opt, sync, directory, entry):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(net, [opt])
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)
    set_state_dict(net, [opt], model_state_dict=model_sd, optim_state_dict=optim_sd)
    # then each rank's own state (Lion Cub's momenta differ across nodes: DCP keeps one replica)
    lowbit_strategy.load_rank_states(sync, entry, directory)


def _check_resume(rank, world_size, tmp):
    import os

    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=PER_NODE))
    at = 3  # the staged optimizers are in their compression stage, Lion's momenta differ across nodes
    for name in ("lion_1bit", "onebit_adam", "turboquant"):
        cfg, make_opt, _ = CASES[name]
        straight, _, _ = _sharded(rank, cfg, make_opt, STEPS, mesh)
        half, half_opt, half_sync = _sharded(rank, cfg, make_opt, at, mesh)
        directory = os.path.join(tmp, name)
        entry = _save(half, half_opt, half_sync, directory)
        net = _sharded_model(mesh)
        opt = make_opt(net.parameters())
        sync = lowbit_strategy.attach_sharded(net, [opt], LowBitConfig(**cfg, ranks_per_node=PER_NODE), mesh=mesh)
        _load(net, opt, sync, directory, entry)
        for step in range(at + 1, STEPS + 1):
            opt.zero_grad()
            loss(net, rank, step).backward()
            opt.step()
        assert all(torch.equal(a, b) for a, b in zip(_full(net), _full(straight))), f"{name}: resumed on rank {rank}"
        # at another world size the per-shard states (ranks with different local shapes) are
        # refused, naming why, instead of being averaged or taken from rank 0
        states: list = [None] * world_size
        dist.all_gather_object(states, sync.state_dict())
        with pytest.raises(ValueError, match="different shards"):
            sync.algorithm.merge_states(states)


@pytest.mark.slow
def test_sharded_checkpoints_resume_bit_for_bit(tmp_path):
    run_ranks(2 * PER_NODE, _check_resume, str(tmp_path))


def _check_clipping(rank, world_size):
    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=PER_NODE))
    intra = mesh["shard"].get_group()
    cfg, make_opt, _ = CASES["lion_1bit"]
    net = _sharded_model(mesh)
    opt = make_opt(net.parameters())
    # clipping after backward: the exchange must be formed at the step (overlap off), from clipped gradients
    lowbit_strategy.attach_sharded(net, [opt], LowBitConfig(**cfg, ranks_per_node=PER_NODE, overlap=False), mesh=mesh)
    replica = model()  # the node's mean gradient, to check the norm clip_grad_norm_ sees
    for step in range(1, STEPS + 1):
        opt.zero_grad()
        loss(net, rank, step).backward()
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        with torch.no_grad():
            for r, p in zip(replica.parameters(), net.parameters()):
                r.copy_(p.full_tensor())
        replica.zero_grad()
        loss(replica, rank, step).backward()
        grads = [p.grad.mul(0.5) for p in replica.parameters()]
        for gr in grads:
            dist.all_reduce(gr, group=intra)
        node_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(gr) for gr in grads]))
        # the node is the worker: its gradient is clipped by its own norm
        assert torch.allclose(norm.full_tensor(), node_norm, rtol=1e-5), (float(norm.full_tensor()), float(node_norm))
        opt.step()
    full = torch.cat([t.reshape(-1) for t in _full(net)])
    every = [torch.empty_like(full) for _ in range(world_size)]
    dist.all_gather(every, full)
    assert all(torch.equal(every[0], e) for e in every) and bool(torch.isfinite(full).all())


def _check_overlap(rank, world_size):
    """The exchange starts during backward, unit by unit, and gives the step-time form's bits."""
    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=PER_NODE))
    for name in ("lion_1bit", "onebit_adam", "turboquant"):
        cfg, make_opt, _ = CASES[name]
        # Lion Cub launches its warm-up's exchange the same way; the staged optimizers average
        # their warm-up's gradients in FSDP's all-reduce hook (nothing in flight)
        warmup = 0 if cfg["algorithm"] == "lion" else 2
        finals, seen = [], {}
        for overlap in (True, False):
            net = _sharded_model(mesh)
            if overlap:  # attached twice (a second fit): the second attach's hooks replace the first's
                lowbit_strategy.attach_sharded(net, [make_opt(net.parameters())], LowBitConfig(**cfg), mesh=mesh)
            opt = make_opt(net.parameters())
            sync = lowbit_strategy.attach_sharded(
                net, [opt], LowBitConfig(**cfg, ranks_per_node=PER_NODE, overlap=overlap), mesh=mesh
            )
            assert all(len(p._post_accumulate_grad_hooks or {}) == 1 for p in net.parameters()), name
            assert sync.overlap is overlap, name
            probes: list[bool] = []
            # the gradient of the embedding's output: both linear units have been reduced, the
            # embedding's own unit not yet (backward is still running)
            def probe(module, inputs, out, probes=probes, opt=opt):
                out.register_hook(lambda g: probes.append(opt.communicator.pending()))

            net[0].register_forward_hook(probe)
            after = []
            for step in range(1, STEPS + 1):
                opt.zero_grad()
                loss(net, rank, step).backward()
                after.append(opt.communicator.pending())
                if overlap and step > warmup and hasattr(opt, "_launched"):  # every bucket launched in backward
                    assert opt._launched == set(opt.layout()), (name, step)
                opt.step()
            seen[overlap] = (probes, after)
            finals.append(_full(net))
        compressed = [False] * warmup + [True] * (STEPS - warmup)
        assert seen[True] == (compressed, compressed), (name, seen[True])
        assert seen[False] == ([False] * STEPS, [False] * STEPS), (name, seen[False])
        assert all(torch.equal(a, b) for a, b in zip(*finals)), f"{name}: overlapped != step-time on rank {rank}"
        # a NaN on one node's ranks, after the warm-up: the step is skipped on every rank, the
        # launched exchanges finished and dropped (the next steps pair up), replicas stay identical
        net, opt, _ = _attached(cfg, make_opt, mesh)
        for step in range(1, STEPS + 1):
            opt.zero_grad()
            out = loss(net, rank, step)
            (out * float("nan") if step == warmup + 2 and rank < PER_NODE else out).backward()
            before = _full(net)
            with pytest.warns(RuntimeWarning, match="non-finite") if step == warmup + 2 else nullcontext():
                opt.step()
            if step == warmup + 2:
                assert all(torch.equal(a, b) for a, b in zip(before, _full(net))), (name, rank)
        assert opt.skipped_steps == 1, (name, opt.skipped_steps)
        full = torch.cat([t.reshape(-1) for t in _full(net)])
        every = [torch.empty_like(full) for _ in range(world_size)]
        dist.all_gather(every, full)
        assert all(torch.equal(every[0], e) for e in every) and bool(torch.isfinite(full).all()), name


@pytest.mark.slow
def test_the_exchange_starts_during_backward_and_equals_the_step_time_form():
    run_ranks(2 * PER_NODE, _check_overlap)


@pytest.mark.slow
def test_clipping_clips_each_nodes_gradient_by_its_norm_and_replicas_stay_identical():
    run_ranks(2 * PER_NODE, _check_clipping)


class _OneBucket(_Bucket):
    """Every shard gradient of the oracle's model as one DDP-like bucket, the last of its
    iteration (BitDP's codes and scales are per row, its full-precision part an exact mean:
    bucketing changes nothing)."""

    def __init__(self, params):
        super().__init__(params, torch.cat([p.grad.reshape(-1) for p in params]))

    def is_last(self):
        return True


def _check_bitdp(rank, world_size):
    from lowbit_strategy import BitDPState, bitdp_hook

    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=PER_NODE))
    intra, inter = mesh["shard"].get_group(), mesh["replicate"].get_group()
    local = rank % PER_NODE
    adamw = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=False)  # noqa: E731
    # 1-bit Adam's warm-up in BitDP's codes (warmup_wire="int2") is this oracle with bf16 for
    # what BitDP does not code, and AdamW
    adam = lambda ps: lowbit_strategy.OneBitAdam(ps, lr=1e-2, weight_decay=0.01, freeze_step=STEPS)  # noqa: E731
    coded = dict(algorithm="onebit_adam", warmup_wire="int2")
    for form, feedback, cfg, make, full_wire in (
        ("allgather", False, dict(algorithm="bitdp", bitdp_bits=2, form="allgather"), adamw, "fp32"),
        ("two_stage", True, dict(algorithm="bitdp", bitdp_bits=2, form="two_stage", error_feedback=True), adamw, "fp32"),
        ("allgather", True, coded, adam, "bf16"),
    ):
        net, _, sync = _sharded(rank, cfg, make, STEPS, mesh)
        # the oracle: BitDP's DDP hook over the N = 2 workers of this local rank, on the rows
        replica, shard_model = model(), model()
        for p in shard_model.parameters():
            p.data = p.data[slice(*_rows(p.shape[0], local))].clone()
        shards = list(shard_model.parameters())
        state = BitDPState(bits=2, process_group=inter, start_iter=2, form=form, error_feedback=feedback,
                           model=shard_model, warmup_wire="bf16", full_wire=full_wire)  # (warmup_wire's default)
        opt = adamw(shards)
        for step in range(1, STEPS + 1):
            replica.zero_grad()
            loss(replica, rank, step).backward()
            for p, s in zip(replica.parameters(), shards):
                g = p.grad.mul(0.5)
                dist.all_reduce(g, group=intra)
                s.grad = g[slice(*_rows(p.shape[0], local))].clone()
            bucket = _OneBucket(shards)
            mean = bitdp_hook(state, bucket).wait()
            for s, v in zip(shards, bucket.gradients()):
                s.grad.copy_(v)
            del mean
            opt.step()
            _rows_back(replica, shards, intra)
        got = _full(net)
        assert all(torch.equal(a, b.detach()) for a, b in zip(got, replica.parameters())), f"{cfg} rank {rank}"
        assert sum(log.bytes_sent for log in sync.traffic_logs()) > 0
        if feedback:  # its rank-local state round-trips in local shapes
            sync.load_state_dict(sync.state_dict())


@pytest.mark.slow
def test_bitdp_sharded_equals_its_oracle_in_both_forms():
    run_ranks(2 * PER_NODE, _check_bitdp)


def _check_lamb(rank, world_size):
    """1-bit LAMB sharded: its trust ratios, momentum scaling coefficients and r are the whole
    parameters' (node reductions of the shards' norms and maxima). Its warm-up is DDP's LAMB
    up to the order of the norms' sums; afterwards the compression buckets are the sharded
    layout's, so there is no bit-exact DDP twin: replicas identical, the whole-parameter
    statistics the same on every rank, finite."""
    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=PER_NODE))
    make = lambda ps: lowbit_strategy.OneBitLamb(ps, lr=1e-2, freeze_step=2)  # noqa: E731
    cfg = dict(algorithm="onebit_lamb", bucket_size_mb=0.0005, scale_block=16)
    net, _, _ = _sharded(rank, cfg, make, 2, mesh)
    ddp, _, _ = train(rank, make, LowBitConfig(**cfg, topology="hierarchical", ranks_per_node=PER_NODE), 2)
    for a, b in zip(_full(net), ddp.module.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7), (a - b).abs().max()
    net, opt, _ = _sharded(rank, cfg, make, STEPS, mesh)
    full = torch.cat([t.reshape(-1) for t in _full(net)])
    every = [torch.empty_like(full) for _ in range(world_size)]
    dist.all_gather(every, full)
    assert all(torch.equal(every[0], e) for e in every) and bool(torch.isfinite(full).all())
    stats = torch.stack([opt.state[p][k].reshape(()) for p in net.parameters()
                         for k in ("lamb_coeff_freeze", "scaling_coeff", "last_factor")])
    every = [torch.empty_like(stats) for _ in range(world_size)]
    dist.all_gather(every, stats)
    assert all(torch.equal(every[0], e) for e in every), "whole-parameter statistics differ across ranks"


@pytest.mark.slow
def test_onebit_lamb_sharded_uses_whole_parameter_statistics():
    run_ranks(2 * PER_NODE, _check_lamb)
