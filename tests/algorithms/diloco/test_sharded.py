"""DiLoCo sharded (FSDP2 inside each of 2 emulated nodes of 2 ranks, the outer sync across)
against the oracle of the sharded path (:func:`tests.integrations.test_sharded._oracle`): the
flat DiLoCo over the cross-node group, run on this local rank's dim-0 rows of every
parameter fed its node's mean gradient. The outer state is the shard's (1/L per rank), and
nothing crosses nodes between rounds."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import lowbit_strategy
from lowbit_strategy import LowBitConfig
from tests.algorithms.diloco import oracle
from tests.distributed import run_ranks
from tests.integrations.test_sharded import PER_NODE, _full, _oracle, _sharded

STEPS = 7
CASES = [
    dict(algorithm="diloco", diloco=dict(sync_every=3, compression="int4")),
    dict(algorithm="diloco", diloco=dict(sync_every=3, compression="sign", fragments=2, delay=1)),
]


def _check(rank, world_size):
    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=PER_NODE))
    groups = (mesh["shard"].get_group(), mesh["replicate"].get_group())
    for cfg in CASES:
        net, _, sync = _sharded(rank, cfg, oracle.adamw, STEPS, mesh)
        want, _ = _oracle(rank, cfg, oracle.adamw, STEPS, 0, groups)
        assert all(torch.equal(a, b) for a, b in zip(_full(net), want)), f"{cfg}: sharded != oracle on rank {rank}"
        shard = sum(p.to_local().numel() for p in net.parameters())
        assert sum(f.n for f in sync.fragments) == shard  # the outer state is this rank's shard only
        assert sync.syncs > 0 and sync.traffic.bytes_sent > 0 and sync.node_traffic.bytes_sent == 0
        if cfg["diloco"].get("delay", 0) == 0:  # at a round's end (step 6) the nodes' replicas agree
            net, _, _ = _sharded(rank, cfg, oracle.adamw, 6, mesh)
            flat = torch.cat([t.reshape(-1) for t in _full(net)])
            every = [torch.empty_like(flat) for _ in range(world_size)]
            dist.all_gather(every, flat)
            assert all(torch.equal(every[0], e) for e in every[1:]), "replicas differ after a round"


@pytest.mark.slow
def test_sharded_diloco_equals_the_flat_oracle_on_shards():
    run_ranks(2 * PER_NODE, _check)
