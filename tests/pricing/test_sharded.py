"""The sharded layout's cross-node cost model, by hand (no process group; the recorded bytes
are checked against it on 2 x 2 ranks in tests/integrations/test_sharded_bytes.py)."""

import pytest

from lowbit_strategy.pricing import nodes as cm
from lowbit_strategy.pricing import sharded as cs
from lowbit_strategy.collectives import wire


def test_local_shapes_are_fsdp2_dim0_chunks():
    assert [cs.local_shape((5, 16), 2, j) for j in range(2)] == [(3, 16), (2, 16)]
    assert [cs.local_shape((1,), 2, j) for j in range(2)] == [(1,), (0,)]
    assert [cs.local_shape((10, 3), 4, j) for j in range(4)] == [(3, 3), (3, 3), (3, 3), (1, 3)]
    assert [cs.local_shape((2, 3), 4, j) for j in range(4)] == [(1, 3), (1, 3), (0, 3), (0, 3)]
    # the reduce-scatter output is padded to ceil(d0/L) rows on every rank
    assert cs.padded_shard_numel([(5, 16), (5,), (1,)], 2) == 3 * 16 + 3 + 1


def test_hsdp_is_one_allreduce_per_unit_on_every_local_rank():
    units = [[(20, 8)], [(16, 24), (16,)], [(5, 16), (5,)], []]
    fp32 = cs.hsdp_sends(units, 2, 2)
    per_unit = [wire.allreduce_bytes(4 * n, 2) for n in (80, 8 * 24 + 8, 3 * 16 + 3)]
    assert fp32.network == (sum(per_unit),) * 2 and fp32.network_per_node == 2 * sum(per_unit)
    assert cs.hsdp_sends(units, 2, 2, itemsize=2).network_per_node * 2 == fp32.network_per_node
    assert fp32.rounds(2) == 3 * 2  # three units with parameters, 2·ceil(log2 2) each


def test_optimizer_buckets_follow_the_layout_over_local_shards():
    shapes = [(20, 8), (16, 24), (16,), (5, 16), (5,), (1, 5), (1,)]
    # local rank 1: (10,8) (8,24) (8,) (2,16) (2,) and two empty shards, left out
    assert cs.local_buckets(shapes, 2, 1, 10**6, last_first=False) == [80 + 192 + 8 + 32 + 2]
    assert cs.local_buckets(shapes, 2, 1, 100, last_first=True) == [2 + 32 + 8, 192, 80]
    assert cs.local_buckets(shapes, 2, 1, 100, last_first=False) == [80, 192, 8 + 32 + 2]
    sends = cs.optimizer_sends("1bit", shapes, 2, 2, bucket_numel=100, last_first=True)
    assert sends.network[1] == sum(cm.bucket_sends("1bit", n, 2, flagged=False).total for n in (42, 192, 80))
    by_size = cs.optimizer_sends(lambda n: "fp32" if n < 50 else "1bit", shapes, 2, 2, bucket_numel=100,
                                 last_first=True)
    assert by_size.buckets[1][0] == cm.bucket_sends("fp32", 42, 2, flagged=False)
    assert cs.optimizer_sends("1bit", [(1,)], 2, 2, bucket_numel=100, last_first=True).buckets[1] == ()


def test_agreement_spans_every_rank_and_momentum_sync_only_holders():
    assert cs.agreement_sends(7, 2, 2).network == (wire.allreduce_bytes(32, 4),) * 2
    sync = cs.momentum_sync_sends([(1, 5)], 2, 2)
    assert sync.network == (wire.allreduce_bytes(20, 2), 0)
    assert (cs.agreement_sends(7, 2, 2) + sync).network_per_node == 2 * wire.allreduce_bytes(32, 4) + 20
    with pytest.raises(ValueError, match="ranks per node differ"):
        _ = sync + cs.agreement_sends(7, 2, 4)


def test_a_node_link_carries_the_sum_and_time_follows_it():
    """At 8 x 8 a sharded all-to-all form sends, per node, what its flat form at N sends per rank
    (each local rank an L-th of it), so HSDP's ring pays 2(N-1)/N of the fp32 model per node."""
    shapes = [(4096, 4096)] * 4
    hsdp = cs.hsdp_sends([[s] for s in shapes], 8, 8)
    n = 4 * 4096 * 4096
    assert hsdp.network_per_node == pytest.approx(2 * 7 / 8 * 4 * n, rel=1e-6)
    onebit = cs.optimizer_sends("compensated", shapes, 8, 8, bucket_numel=2**30, last_first=True, block=32768)
    assert onebit.network_per_node == 8 * cm.bucket_sends("compensated", n // 8, 8, flagged=False, block=32768).total
    cluster = cm.Cluster(8, 8, 25.0, inter_latency_us=0.0)
    assert cs.sharded_seconds(hsdp, cluster) == pytest.approx(8 * hsdp.network_per_node / 25e9)
    assert cs.sharded_seconds(hsdp, cm.Cluster(1, 8, 25.0)) == 0.0
    assert cs.sharded_seconds(hsdp, cm.Cluster(8, 8, 25.0)) > cs.sharded_seconds(hsdp, cluster)
