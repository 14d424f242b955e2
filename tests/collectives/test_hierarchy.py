"""Node-aware synchronization (collectives/hierarchy.py) on 4 real gloo ranks laid out as 2
nodes x 2 ranks (the launcher's variables set per rank, as torchrun sets them): the layout
checks, and Lion Cub's hierarchical form against a single-process oracle in which each node
is one worker that sees its node's mean gradient, bit for bit."""
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
from tests.training import batch, model

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
    with pytest.raises(lowbit_strategy.LowBitSetupError, match="no hierarchical form yet"):
        lowbit_strategy.attach(
            nn.parallel.DistributedDataParallel(model()),
            [torch.optim.AdamW(model().parameters())],
            LowBitConfig(algorithm="onebit_adam", topology="hierarchical"),
        )

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

    # ---- one node: nothing compressed crosses a network; Lion on the node's mean ------
    cfg = LowBitConfig(algorithm="lion", mode="1bit", topology="hierarchical", ranks_per_node=4, bucket_size_mb=0.0005)
    net, sync = _train(rank, cfg)
    for a, b in zip(net.module.parameters(), _oracle("1bit", 1, 4)):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=0)
    assert not any(r.op.startswith("majority") for log in sync.traffic_logs() for r in log.records)


def test_two_nodes_of_two_ranks():
    run_ranks(NODES * PER_NODE, _check)
