"""The cross-node cost model of one FSDP group over every rank (``fsdp_shard="world"``), by hand
and against bytes measured on 2 emulated nodes x 2 ranks (no process group here: the logged
bytes are checked step by step in tests/integrations/test_sharded_bytes.py)."""

import pytest

from benchmarks.nodes.sharded_projection import gpt_model
from lowbit_strategy.codecs import blockwise
from lowbit_strategy.pricing import world as cw
from lowbit_strategy.collectives import fsdp_reduce_scatter as qrs
from lowbit_strategy.collectives import wire
from lowbit_strategy.pricing.nodes import Cluster


def test_exact_reduce_scatter_is_one_ring_edge_per_node_and_twice_that_on_gloo():
    c = 1000
    ring = cw.reduce_scatter_call(c, 2, 2, "fp32")
    assert ring.sent == ring.link == 3 * c * 4  # (W-1)·c·s; ranks node by node: one ring edge leaves a node
    gloo = cw.reduce_scatter_call(c, 2, 2, "fp32", impl="gloo")
    assert gloo.sent == gloo.link == wire.allreduce_bytes(4 * c * 4, 4) == 2 * ring.link  # an allreduce, sliced
    assert cw.reduce_scatter_call(c, 8, 8, "bf16").link == 63 * c * 2
    assert cw.reduce_scatter_call(c, 1, 8, "fp32").link == 0  # one node: nothing crosses
    with pytest.raises(ValueError, match="impl"):
        cw.reduce_scatter_call(c, 2, 2, "fp32", impl="nccl")


def test_quantized_reduce_scatter_rows_across_nodes():
    c = 600
    row = sum(blockwise.row_bytes(c, 4))
    one = cw.reduce_scatter_call(c, 2, 2, "int4")
    assert one.sent == qrs.reduce_scatter_bytes(c, 4, 4, 4)[1] == 3 * row  # what the log records
    assert one.link == 2 * 2 * row  # L ranks, each W-L rows to the other node
    two = cw.reduce_scatter_call(c, 2, 2, "int4", two_hop=True)
    assert (two.node, two.sent) == qrs.reduce_scatter_bytes(c, 4, 4, 4, nodes=2)
    assert two.link == 2 * row  # L x (N-1) rows: L x fewer than one hop
    # at 8 x 8 two hops send L(N-1) rows per node against L(W-L) for one hop: 8x fewer
    flat, qgz = (cw.reduce_scatter_call(c, 8, 8, "int8", two_hop=hop) for hop in (False, True))
    assert flat.link == 8 * qgz.link
    # two hops on one node, or one rank per node, are one hop
    assert cw.reduce_scatter_call(c, 4, 1, "int4", two_hop=True) == cw.reduce_scatter_call(c, 4, 1, "int4")


def test_all_gathers_run_in_forward_and_again_in_backward_but_the_root_once():
    units = [[(8, 4)], [(16, 4), (16,)], [(4, 4)], []]
    s = cw.world_sends(units, 2, 2)
    c = [8, 16 + 4, 4]  # padded shard elements at W = 4
    gathers = [cw.all_gather_call(k, 2, 2) for k in c]
    assert s.forward.link == sum(g.link for g in gathers) == 3 * 4 * sum(c)
    assert s.backward_gather.link == gathers[1].link + gathers[2].link  # unit 0, the root, is not resharded
    assert s.reduce_scatter.link == sum(cw.reduce_scatter_call(k, 2, 2).link for k in c)
    assert cw.world_sends(units[:3], 2, 2, root=-1).backward_gather.link == gathers[0].link + gathers[1].link
    assert cw.world_sends(units, 2, 2, reshard_after_forward=False).backward_gather.link == 0
    assert s.link == s.logged  # ring primitives only: every byte one rank sends crosses on one edge
    fwd, bwd = cw.world_seconds(s, Cluster(2, 2, 1.0, inter_latency_us=0.0))
    assert fwd == pytest.approx(8 * s.forward.link / 1e9) and bwd == pytest.approx(8 * (s.link - s.forward.link) / 1e9)
    assert cw.world_seconds(s, Cluster(1, 4, 1.0)) == (0.0, 0.0)


def test_the_e2e_gpt_at_2x2_matches_the_bytes_the_benchmark_measured():
    """benchmarks.nodes.driver --sharded --world's GPT (d 128, 4 layers, vocabulary 256, 64 positions,
    the root last here): the ranks' logs recorded these per step, every rank, on gloo; the
    links carried them plus ~5 % of TCP/IP headers."""
    units = gpt_model(128, 4, 256, 64).units
    fp32 = cw.world_sends(units, 2, 2, impl="gloo", root=-1)
    assert (fp32.logged, fp32.link) == (9_888_000, 9_888_000)
    two = cw.world_sends(units, 2, 2, reduce_scatter="int4", two_hop=True, impl="gloo", root=-1)
    assert (two.logged, two.link) == (4_990_020, 5_097_864)
    # the parameters' all-gathers are what is left: 96 % of the two-hop row's link bytes
    assert (two.forward.link + two.backward_gather.link) / two.link == pytest.approx(0.958, abs=1e-3)
