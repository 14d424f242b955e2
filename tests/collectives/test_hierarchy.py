"""Node-aware synchronization (collectives/hierarchy.py) on 4 real gloo ranks laid out as 2
nodes x 2 ranks (the launcher's variables set per rank, as torchrun sets them): the layout
checks; Lion Cub's hierarchical form against a single-process oracle in which each node is
one worker that sees its node's mean gradient, bit for bit; the staged optimizers (1-bit
Adam, TurboQuant) against their flat form run by N = 2 workers (one subgroup of the same 4
processes) fed their node's mean gradient; one node against DDP with the uncompressed
optimizer; cross-node bytes against the flat run."""
import os

import pytest
import torch
from torch import nn

import lowbit_strategy
from lowbit_strategy import LowBitConfig
from lowbit_strategy.codecs import lp_quantize_levels
from lowbit_strategy.collectives import hierarchy, wire
from lowbit_strategy.collectives.summed import max_levels
from lowbit_strategy.validation import ConfigError
from tests.distributed import run_ranks
from tests.training import batch, loss, model

pytestmark = pytest.mark.slow

STEPS, LR, WD, BETAS = 5, 0.01, 0.1, (0.9, 0.99)
NODES, PER_NODE = 2, 2


def _grads(net, rank, step):
    net.zero_grad()
    x, y = batch(rank, step)
    nn.functional.cross_entropy(net(x), y).backward()
    return [p.grad.detach().clone() for p in net.parameters()]


def _oracle(mode, nodes, per_node, bits=None):
    """Lion Cub Algorithm 1 with ``nodes`` workers; worker k's gradient is the mean of its
    ranks' gradients, summed in rank order then divided (the intra-node allreduce's order)."""
    nets = [model() for _ in range(nodes * per_node)]
    params = list(nets[0].parameters())
    replicas = [list(net.parameters()) for net in nets]
    moms = [[torch.zeros_like(t) for t in params] for _ in range(nodes)]
    b1, b2 = BETAS
    levels = max_levels(nodes, bits or 8) if mode == "lp" else 0
    for step in range(1, STEPS + 1):
        ranks = [_grads(nets[r], r, step) for r in range(nodes * per_node)]
        grads = []
        for k in range(nodes):
            mine = ranks[k * per_node : (k + 1) * per_node]
            total = [sum(g[i] for g in mine[1:]) + mine[0][i] if len(mine) > 1 else mine[0][i] for i in range(len(params))]
            grads.append([t / per_node for t in total])
        for i, theta in enumerate(params):
            cs = [moms[k][i] * b1 + (1 - b1) * grads[k][i] for k in range(nodes)]
            tie_up = step % 2 == 1
            if nodes == 1:
                d = torch.sign(cs[0])
            elif mode == "1bit":
                ups = sum(((c > 0) | ((c == 0) & tie_up)).int() for c in cs)
                d = torch.sign(2 * ups - nodes).float()
                d = torch.where(d == 0, torch.tensor(1.0 if tie_up else -1.0), d)
            elif mode == "lp":
                d = torch.sign(sum(lp_quantize_levels(c.reshape(-1), levels, 1.0).int() for c in cs)).float()
                d = d.view_as(theta)
            else:  # fp32
                d = torch.sign(sum(c.reshape(-1) for c in cs)).view_as(theta)
            with torch.no_grad():
                for replica in replicas:
                    replica[i].mul_(1 - LR * WD).add_(d, alpha=-LR)
            for k in range(nodes):
                moms[k][i].mul_(b2).add_(grads[k][i], alpha=1 - b2)
    return [t.detach() for t in params]


def _train(rank, cfg, steps=STEPS):
    net = nn.parallel.DistributedDataParallel(model())
    opt = lowbit_strategy.Lion(net.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    sync = lowbit_strategy.attach(net, [opt], cfg)
    for step in range(1, steps + 1):
        net.zero_grad()
        x, y = batch(rank, step)
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net, sync


def _raises_everywhere(cfg, match, environ=None):
    with pytest.raises(ConfigError, match=match):
        hierarchy.resolve(cfg, None, environ=environ)


def _staged(rank, cfg, make_opt, group=None, node_mean=False, plain=False, steps=STEPS):
    """(params, sync) after STEPS steps. ``node_mean``: this process is its node's worker in
    a flat run over ``group`` (it accumulates half of each of its node's two ranks' losses:
    the node's mean gradient, bit for bit, since halving is exact); ``plain``: plain DDP
    (default hook) and the optimizer without the algorithm."""
    net = nn.parallel.DistributedDataParallel(model(), process_group=group)
    opt = make_opt(net.parameters())
    sync = None if plain else lowbit_strategy.attach(net, [opt], cfg, group=group)
    node = rank // PER_NODE
    for step in range(1, steps + 1):
        opt.zero_grad()
        if node_mean:
            with net.no_sync():
                (0.5 * loss(net, node * PER_NODE, step)).backward()
            (0.5 * loss(net, node * PER_NODE + 1, step)).backward()
        else:
            loss(net, rank, step).backward()
        opt.step()
    return [p.detach().clone() for p in net.module.parameters()], sync


def _resume(rank, cfg, make_opt, directory):
    """STEPS steps straight, and 3 steps + a checkpoint (every rank's state in files) + a
    resume for the rest, in the hierarchical form: the same weights, bit for bit."""
    straight, _ = _staged(rank, cfg, make_opt)
    net = nn.parallel.DistributedDataParallel(model())
    opt = make_opt(net.parameters())
    sync = lowbit_strategy.attach(net, [opt], cfg)
    for step in range(1, STEPS + 1):
        if step == 4:  # save, then resume into fresh objects
            entry = [lowbit_strategy.save_rank_states(sync, directory=directory)]
            torch.distributed.broadcast_object_list(entry, src=0)
            weights, optim = net.module.state_dict(), opt.state_dict()
            net = nn.parallel.DistributedDataParallel(model())
            net.module.load_state_dict(weights)
            opt = make_opt(net.parameters())
            opt.load_state_dict(optim)
            sync = lowbit_strategy.attach(net, [opt], cfg)
            lowbit_strategy.load_rank_states(sync, entry[0], directory)
        opt.zero_grad()
        loss(net, rank, step).backward()
        opt.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(straight, net.module.parameters())), cfg.algorithm


def _network_bytes(sync, prefix=""):
    return sum(r.bytes_sent for log in sync.traffic_logs() for r in log.records if r.op.startswith(prefix))


def _per_node(value):
    t = torch.tensor([float(value)], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return float(t) / NODES


def _communicators(rank, mine):
    """The staged communicators' hierarchical form against their flat form over N = 2
    workers (``mine``: local rank j of both nodes) that treat each shard as a bucket, fed
    the node's data: bit for bit, error feedback included (3 calls)."""
    from lowbit_strategy.algorithms.onebit.communicator import OneBitCommunicator
    from lowbit_strategy.algorithms.turboquant.communicator import TurboQuantCommunicator

    topo = hierarchy.resolve(LowBitConfig(), None)
    n, node = 645, rank // PER_NODE
    for make in (
        lambda **kw: OneBitCommunicator(bucket_size_mb=1.0, block=64, **kw),
        lambda **kw: TurboQuantCommunicator(bucket_size_mb=1.0, block=64, form="two_stage", **kw),
    ):
        hier, flat = make(group=None, topology=topo), make(group=mine)
        size = topo.shard_length(n, hier.shard_align)
        for call in range(3):
            x = torch.randn(n, generator=torch.Generator().manual_seed(100 * call + node))
            ((whole,),), bad = hier.synchronize([((0,), [x.clone()])])
            parts = [flat.synchronize([((1, j), [x[j * size : (j + 1) * size].clone()])]) for j in range(PER_NODE)]
            hier.commit(), flat.commit()
            assert not bool(bad) and torch.equal(whole, torch.cat([p[0][0][0] for p in parts]))
        assert hier.traffic.node_bytes_sent > 0 and hier.world_size == NODES


def _check_staged(rank):
    # the flat oracle's groups: local rank j of both nodes (every rank makes every group)
    pairs = [torch.distributed.new_group([j, j + PER_NODE]) for j in range(PER_NODE)]
    mine = pairs[rank % PER_NODE]
    _communicators(rank, mine)
    adam = lambda params: lowbit_strategy.OneBitAdam(params, lr=0.01, freeze_step=2)  # noqa: E731
    turbo = lambda params: lowbit_strategy.TurboQuantAdamW(params, lr=0.01, warmup_steps=2)  # noqa: E731
    for cfg, make_opt, prefix in (
        (LowBitConfig(algorithm="onebit_adam", bucket_size_mb=0.001, scale_block=64), adam, "compensated"),
        (LowBitConfig(algorithm="turboquant", bucket_size_mb=0.001, block=64), turbo, "turboquant"),
    ):
        # the warm-up (AdamW on the mean of the node means) against the flat form of N
        # workers fed their node's mean gradient, bit for bit
        hier, _ = _staged(rank, cfg, make_opt, steps=2)
        oracle, _ = _staged(rank, cfg.replace(topology="flat"), make_opt, group=mine, node_mean=True, steps=2)
        assert all(torch.equal(a, b) for a, b in zip(hier, oracle)), prefix
        # then the compressed stage: replicas identical, cross-node bytes <= 1/L of flat's
        hier, sync = _staged(rank, cfg, make_opt)
        every = [torch.empty_like(hier[1]) for _ in range(NODES * PER_NODE)]
        torch.distributed.all_gather(every, hier[1])
        assert all(torch.equal(every[0], e) for e in every), prefix
        _, flat_sync = _staged(rank, cfg.replace(topology="flat"), make_opt)
        hier_bytes, flat_bytes = _per_node(_network_bytes(sync, prefix)), _per_node(_network_bytes(flat_sync, prefix))
        assert 0 < hier_bytes <= flat_bytes / PER_NODE, (prefix, hier_bytes, flat_bytes)

    # warmup_wire="int2": the warm-up in BitDP's codes on the node means equals the flat form's
    # of N workers fed their node's mean, bit for bit; its cross-node bytes <= 1/L of flat's;
    # a checkpoint in the middle of it (step 4 of 5) resumes bit for bit
    coded = LowBitConfig(algorithm="onebit_adam", bucket_size_mb=0.001, scale_block=64, warmup_wire="int2")
    adam5 = lambda params: lowbit_strategy.OneBitAdam(params, lr=0.01, freeze_step=5)  # noqa: E731
    hier, sync = _staged(rank, coded, adam5)
    oracle, _ = _staged(rank, coded.replace(topology="flat"), adam5, group=mine, node_mean=True)
    assert all(torch.equal(a, b) for a, b in zip(hier, oracle)), "int2 warm-up"
    _, flat_sync = _staged(rank, coded.replace(topology="flat"), adam5)
    hier_bytes, flat_bytes = _per_node(_network_bytes(sync, "gathered")), _per_node(_network_bytes(flat_sync, "gathered"))
    assert 0 < hier_bytes <= flat_bytes / PER_NODE, ("int2 warm-up", hier_bytes, flat_bytes)
    _resume(rank, coded, adam5, os.path.join(os.environ["HIERARCHY_TEST_TMP"], "resume-int2"))

    # BitDP (gradient level, any optimizer): each channel row is coded on its own, so the
    # hierarchical form equals the flat one of N workers fed their node's mean, bit for bit,
    # in both forms, error feedback included; the warm-up is DDP's mean of the node means
    adamw = lambda params: torch.optim.AdamW(params, lr=0.01)  # noqa: E731
    for form, extra in (("allgather", {}), ("two_stage", {"error_feedback": True})):
        cfg = LowBitConfig(algorithm="bitdp", form=form, bucket_size_mb=0.001, **extra)
        hier, sync = _staged(rank, cfg, adamw)
        oracle, _ = _staged(rank, cfg.replace(topology="flat"), adamw, group=mine, node_mean=True)
        assert all(torch.equal(a, b) for a, b in zip(hier, oracle)), form
        _, flat_sync = _staged(rank, cfg.replace(topology="flat"), adamw)
        hier_bytes, flat_bytes = _per_node(_network_bytes(sync, "gathered")), _per_node(_network_bytes(flat_sync, "gathered"))
        assert 0 < hier_bytes <= flat_bytes / PER_NODE, (form, hier_bytes, flat_bytes)
    bitdp_one, one_sync = _staged(rank, LowBitConfig(algorithm="bitdp", topology="hierarchical", ranks_per_node=4), adamw)
    ddp_adamw, _ = _staged(rank, LowBitConfig(), adamw, plain=True)
    assert all(torch.equal(a, b) for a, b in zip(bitdp_one, ddp_adamw))
    assert set(one_sync.node_traffic.by_op()) == {"node.mean"}  # the node mean is the result: no gather
    assert one_sync.state.traffic.bytes_sent == 0

    # a resume in the hierarchical form continues bit for bit (node momenta, shard errors)
    directory = os.path.join(os.environ["HIERARCHY_TEST_TMP"], "resume")
    lion = lambda params: lowbit_strategy.Lion(params, lr=LR)  # noqa: E731
    _resume(rank, LowBitConfig(algorithm="lion", mode="1bit", bucket_size_mb=0.001), lion, directory + "-lion")
    _resume(rank, LowBitConfig(algorithm="onebit_adam", bucket_size_mb=0.001, scale_block=64), adam, directory)

    # one node: DDP's mean and the uncompressed optimizer, bit for bit
    onebit = LowBitConfig(algorithm="onebit_adam", bucket_size_mb=0.001, scale_block=64)
    one = dict(topology="hierarchical", ranks_per_node=NODES * PER_NODE)
    hier, sync = _staged(rank, onebit.replace(**one), adam)
    ddp, _ = _staged(rank, onebit, adam, plain=True)
    assert all(torch.equal(a, b) for a, b in zip(hier, ddp))
    assert _network_bytes(sync, "compensated") == 0


def _check(rank, world_size):
    os.environ.update(LOCAL_WORLD_SIZE=str(PER_NODE), GROUP_RANK=str(rank // PER_NODE), LOCAL_RANK=str(rank % 2))
    # ---- the layout ------------------------------------------------------------------
    topo = hierarchy.resolve(LowBitConfig(), None)
    assert topo.hierarchical and (topo.nodes, topo.ranks_per_node, topo.node) == (2, 2, rank // 2)
    assert not hierarchy.resolve(LowBitConfig(topology="flat"), None).hierarchical
    assert hierarchy.resolve(LowBitConfig(ranks_per_node=4), None).hierarchical is False  # auto: one node
    one = hierarchy.resolve(LowBitConfig(topology="hierarchical", ranks_per_node=4), None)
    assert one.hierarchical and one.nodes == 1
    _raises_everywhere(LowBitConfig(ranks_per_node=3), r"ranks_per_node.*3 ranks per node do not divide.*4")
    swapped = {"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(1 - rank // 2)}
    _raises_everywhere(LowBitConfig(), r"contiguous rank blocks.*rank\(s\) \[0, 1, 2, 3\].*--node-rank", swapped)
    disagree = {"LOCAL_WORLD_SIZE": "2" if rank else "4"}
    _raises_everywhere(LowBitConfig(), r"disagree on the ranks per node \(\[2, 4\]\)", disagree)

    # ---- Lion Cub across 2 nodes: the node is the worker -----------------------------
    for mode, extra in (("1bit", {}), ("lp", {"bits": 8, "overlap": False}), ("fp32", {})):
        cfg = LowBitConfig(algorithm="lion", mode=mode, bucket_size_mb=0.0005, **extra)
        net, sync = _train(rank, cfg)
        for a, b in zip(net.module.parameters(), _oracle(mode, NODES, PER_NODE, extra.get("bits"))):
            # (lp without overlap: the step-time path, from the .grad the hook averaged)
            assert torch.equal(a.detach(), b), mode
        logs = sync.traffic_logs()
        network = sum(log.bytes_sent for log in logs)
        node = sum(log.node_bytes_sent for log in logs)
        assert network > 0 and node > 0
        if mode == "1bit":
            # cross-node: the majority vote of N = 2 workers over this rank's half of each
            # bucket: the flat algorithm's bytes at P = 4 per rank, halved per node
            with wire.recording() as flat_log:
                _train(rank, cfg.replace(topology="flat"))
            votes = lambda log: sum(r.bytes_sent for r in log.records if r.op.startswith("majority"))  # noqa: E731
            flat_votes = votes(flat_log)
            hier_votes = sum(votes(log) for log in logs)
            per_node = torch.tensor([hier_votes, flat_votes], dtype=torch.float64)
            torch.distributed.all_reduce(per_node)
            assert per_node[0] <= per_node[1] / PER_NODE, per_node

    # ---- Lion Cub's momentum sync: the mean over the nodes (the workers), each node's ---
    # ranks holding their node's momenta; its link carries them once (a shard per rank)
    from lowbit_strategy.algorithms.lion_cub.communicator import LionCommunicator

    comm = LionCommunicator(LowBitConfig(algorithm="lion"), None, hierarchy.resolve(LowBitConfig(), None))
    base = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    momenta = [base[:600] * (1 + rank // PER_NODE), base[600:].view(20, 20) * (1 + rank // PER_NODE)]
    comm.average_(momenta)
    assert torch.equal(torch.cat([m.reshape(-1) for m in momenta]), base * 1.5)  # (1 + 2) / 2, exact
    lo, hi = comm.topology.shard(1000)
    assert comm.traffic.bytes_sent == wire.allreduce_bytes(4 * (hi - lo), NODES), comm.traffic.by_op()

    # ---- one node: nothing compressed crosses a network; Lion on the node's mean ------
    cfg = LowBitConfig(algorithm="lion", mode="1bit", topology="hierarchical", ranks_per_node=4, bucket_size_mb=0.0005)
    net, sync = _train(rank, cfg)
    for a, b in zip(net.module.parameters(), _oracle("1bit", 1, 4)):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
    assert not any(r.op.startswith("majority") for log in sync.traffic_logs() for r in log.records)
    _check_staged(rank)


def test_two_nodes_of_two_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("HIERARCHY_TEST_TMP", str(tmp_path))  # (spawned ranks inherit the environment)
    run_ranks(NODES * PER_NODE, _check)
