"""The cross-node cost model's arithmetic (no process group; the recorded bytes are checked
against it at P up to 16 in test_scaling.py)."""

import pytest

from lowbit_strategy.pricing import nodes as cm
from lowbit_strategy.collectives import wire
from lowbit_strategy.collectives.hierarchy import Topology


@pytest.mark.parametrize("n,per_node,align", [(645, 2, 64), (130, 8, 64), (3001, 4, 64), (10**5, 8, 1024), (1, 4, 64)])
def test_shards_are_the_topologys(n, per_node, align):
    topos = [Topology(None, 2 * per_node, per_node, 0, j, True) for j in range(per_node)]
    expected = [hi - lo for lo, hi in (t.shard(n, align) for t in topos)]
    assert cm.shard_lengths(n, per_node, align) == expected
    assert cm.shard_size(n, per_node, align) == topos[0].shard_length(n, align)
    assert sum(expected) == n


def test_flat_formulas():
    p, n = 4, 3001
    c = -(-n // 32)
    assert cm.bucket_sends("1bit", n, p) == cm.Sends(all_to_all=3 * (c + 1), all_gather=3 * c)
    assert cm.bucket_sends("ddp", n, p).allreduce == wire.allreduce_bytes(4 * n, p)
    assert cm.bucket_sends("fp32", n, p, flagged=False) == cm.bucket_sends("ddp", n, p)
    assert cm.bucket_sends("lp8", n, p).allreduce == wire.allreduce_bytes(n + 1, p)
    assert cm.bucket_sends("sign", n, 16, flagged=False).allreduce == wire.allreduce_bytes(n, 16)  # 8-bit lane at 16
    assert cm.bucket_sends("sign", n, p, flagged=False).allreduce == wire.allreduce_bytes(-(-n // 2), p)  # 4-bit lane
    nb = -(-8 * c // 64)
    assert cm.bucket_sends("compensated", n, p, block=64).total == 2 * 3 * (c + 4 * nb)
    assert cm.bucket_sends("compensated", n, p).total == 2 * 3 * (c + 4)
    assert cm.bucket_sends("turboquant_allgather", n, p, block=1024).total == 3 * (-(-n // 2) + 4 * 3)
    assert cm.bucket_sends("1bit", n, 1) == cm.Sends()
    with pytest.raises(ValueError, match="unknown collective 'fp8'"):
        cm.bucket_sends("fp8", n, p)


def test_the_node_link_sees_one_ring_edge_but_every_all_to_all_peer():
    """Module docstring: per node, a flat ring crosses with one rank's bytes, an all-to-all
    with about L ranks' (exactly L(P-L)/(P-1) of one); the hierarchical form sends, per node,
    what the flat algorithm sends per rank at N: so the saving is ~L for an all-to-all,
    (P-1)/(N-1) for a ring all-gather, and ~1 for a ring allreduce."""
    nodes, per_node, n = 8, 8, 2**20
    p = nodes * per_node
    ring = cm.bucket_sends("ddp", n, p)
    assert ring.link_bytes(p, per_node) == ring.total
    a2a = cm.Sends(all_to_all=(p - 1) * 100)
    assert a2a.link_bytes(p, per_node) == per_node * (p - per_node) * 100
    assert a2a.link_bytes(per_node, per_node) == 0  # one node: nothing leaves it
    votes_flat = cm.bucket_sends("1bit", n, p, flagged=False)
    votes_node = cm.hierarchical_sends("1bit", n, nodes, per_node, flagged=False)
    ratio = votes_flat.link_bytes(p, per_node) / votes_node.network_per_node
    assert 4 < ratio < per_node  # all-to-all ~L, its all-gather (P-1)/(N-1)·/L ≈ 1.1
    gather = cm.bucket_sends("turboquant_allgather", n, p).link_bytes(p, per_node)
    assert gather / cm.hierarchical_sends("turboquant_allgather", n, nodes, per_node).network_per_node == pytest.approx(
        (p - 1) / (nodes - 1), rel=1e-3
    )
    lanes = cm.bucket_sends("ddp", n, p).link_bytes(p, per_node)
    assert lanes / cm.hierarchical_sends("ddp", n, nodes, per_node).network_per_node == pytest.approx(
        (2 * (p - 1) / p) / (2 * (nodes - 1) / nodes), rel=1e-3
    )


def test_hierarchical_intra_node_and_one_node():
    one = cm.hierarchical_sends("compensated", 4096, 1, 4, align=64, block=64)
    assert one.network_per_node == 0 and one.node == wire.allreduce_bytes(4 * 4096, 4)
    two = cm.hierarchical_sends("compensated", 4096, 2, 4, align=64, block=64)
    assert two.node == wire.allreduce_bytes(4 * 4096, 4) + wire.all_gather_bytes(4 * (1024 + 1), 4)
    assert two.node_per_node == 4 * two.node
    bitdp = cm.bitdp_hierarchical_sends("allgather", [(8, 16), (3, 5)], 20, 1, 4)
    assert bitdp.network_per_node == 0  # one node: the node mean is the result, nothing else sent
    assert bitdp.node == wire.allreduce_bytes(4 * 163, 4)


def test_bucket_seconds():
    cluster = cm.Cluster(8, 8, 25.0, inter_latency_us=0.0)
    flat = cm.bucket_sends("ddp", 10**6, 64)
    assert cm.bucket_seconds(flat, cluster) == pytest.approx(8 * flat.total / 25e9)
    hier = cm.hierarchical_sends("ddp", 10**6, 8, 8, flagged=False)
    t = cm.bucket_seconds(hier, cluster)
    assert t > 8 * hier.network_per_node / 25e9 > 0
    assert cm.bucket_seconds(cm.bucket_sends("1bit", 10**6, 8), cm.Cluster(1, 8, 25.0)) < 1e-4  # NVLink only
