"""The emulated-network harness (benchmarks/harness/netem.py): a real gloo allreduce between two
namespaces over a shaped link, bytes counted on the wire, everything torn down after; and
nodes (2 nodes x 2 ranks): torchrun's variables on every rank, an allreduce among the 4,
intra-node traffic on the node's loopback and absent from its shaped link's counters.

Needs root and iproute2 (CI runs as root); skipped otherwise. Pure parts (rate parsing,
qdisc arguments) are tested everywhere.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.harness.netem import Link, NetemError, Network, parse_rate

ROOT = Path(__file__).resolve().parents[2]

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="the emulated network needs root and iproute2 (`ip`, `tc`) to create namespaces; CI runs as root",
)

ALLREDUCE = textwrap.dedent("""
    import os
    from datetime import timedelta
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=30))
    x = torch.full((65536,), float(dist.get_rank() + 1))
    dist.all_reduce(x)
    assert torch.all(x == 3.0), x[:4]
    print("ok", os.environ["GLOO_SOCKET_IFNAME"], os.environ["MASTER_ADDR"])
    dist.destroy_process_group()
""")


NODES = textwrap.dedent("""
    import json, os, subprocess
    from datetime import timedelta
    import torch, torch.distributed as dist
    from benchmarks.harness.netem import rank_counters
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=30))
    rank, p = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    x = torch.full((65536,), float(rank + 1))
    dist.all_reduce(x)
    assert torch.all(x == p * (p + 1) / 2), x[:4]
    intra = [dist.new_group(list(range(k * per_node, (k + 1) * per_node))) for k in range(p // per_node)]
    cross = [dist.new_group(list(range(j, p, per_node))) for j in range(per_node)]

    def lo_bytes():
        out = subprocess.run(["ip", "-s", "-j", "link", "show", "dev", "lo"], capture_output=True, text=True)
        return json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"]

    def measured(group):  # 4 MB allreduce in `group`: (wire tx, wire rx, loopback tx) of this node
        y = torch.ones(1 << 20)
        dist.barrier(); c0, l0 = rank_counters(), lo_bytes(); dist.barrier()
        dist.all_reduce(y, group=group)
        assert torch.all(y == dist.get_world_size(group))
        dist.barrier(); c1, l1 = rank_counters(), lo_bytes(); dist.barrier()
        return (c1 - c0).wire_tx, (c1 - c0).wire_rx, l1 - l0

    out = {"intra": measured(intra[rank // per_node]), "cross": measured(cross[rank % per_node]),
           "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                   "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE", "GLOO_SOCKET_IFNAME", "MASTER_ADDR",
                   "MASTER_PORT")}}
    print("RESULT " + json.dumps(out), flush=True)
    dist.destroy_process_group()
""")


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout


def test_rates_and_qdiscs():
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("100mbit") == 1e8
    with pytest.raises(ValueError, match="bit"):
        parse_rate("100mbps")  # tc's bps means bytes/s: refused rather than misread
    assert Link("100mbit").qdisc()[:3] == ["tbf", "rate", "100mbit"]
    assert Link().qdisc()[0] == "pfifo" and Link().name == "unshaped"
    assert Link("1gbit", 5).qdisc()[0] == "netem" and Link("1gbit", 5).name == "1gbit+5ms"


@pytest.mark.slow
@needs_root
def test_gloo_allreduce_over_shaped_link_and_teardown():
    net = Network(2, Link("100mbit"))
    with net:
        names = _namespaces()
        assert net.hub in names and all(ns in names for ns in net.namespaces)
        result = net.run([sys.executable, "-c", ALLREDUCE], timeout=50, echo=(), cwd=str(ROOT),
                         env={"TORCH_CPP_LOG_LEVEL": "ERROR"})
    result.check()
    for r in result.ranks:
        assert f"ok lbs{r.rank} 10.213.0.1" in r.output
        # a 256 KiB fp32 allreduce of 2 ranks sends 256 KiB per rank, plus headers
        assert r.counters.wire_tx >= 256 * 1024, r.counters
        assert r.counters.if_tx > 0 and r.counters.wire_rx >= 256 * 1024
    left = _namespaces()
    assert net.prefix not in left, f"namespaces left behind: {left}"


def test_node_layout_and_variables():
    """Pure (no root): rank -> node blocks, torchrun's variables, the per-rank form unchanged."""
    net = Network(nodes=2, ranks_per_node=2, link=Link("1gbit"))
    assert (net.world_size, net.nodes, net.ranks_per_node) == (4, 2, 2)
    assert [net.node_of(r) for r in range(4)] == [0, 0, 1, 1] and net.ranks_of(1) == [2, 3]
    assert net.namespaces[0] == net.namespaces[1] != net.namespaces[2] == net.namespaces[3]
    env = net.env(3)
    assert {k: env[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                "NODE_RANK", "GROUP_WORLD_SIZE", "GLOO_SOCKET_IFNAME", "MASTER_ADDR")} == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
        "NODE_RANK": "1", "GROUP_WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lbs1", "MASTER_ADDR": "10.213.0.1"}
    assert Network(4, ranks_per_node=2).nodes == 2 and Network(nodes=3).world_size == 3
    legacy = Network(3, Link("100mbit"))
    assert legacy.per_rank and legacy.nodes == 3 and len(set(legacy.namespaces)) == 3
    assert legacy.env(2)["LOCAL_RANK"] == "2" and "NODE_RANK" not in legacy.env(2)
    assert legacy.env(2)["GLOO_SOCKET_IFNAME"] == "lbs2"
    for bad in (dict(world_size=5, ranks_per_node=2), dict(world_size=4, nodes=3, ranks_per_node=2),
                dict(nodes=0), dict(nodes=2, ranks_per_node=0), dict()):
        with pytest.raises(ValueError):
            Network(**bad)


@pytest.mark.slow
@needs_root
def test_nodes_allreduce_variables_and_intra_node_traffic():
    """2 nodes x 2 ranks: a 4-rank gloo allreduce; a 4 MB allreduce between the two ranks of
    a node stays on the node's loopback (≈0 on its shaped link), one between the nodes
    crosses it (≥ 4 MB each way: two such groups share the link)."""
    net = Network(nodes=2, ranks_per_node=2, link=Link("1gbit"))
    with net:
        names = _namespaces()
        assert net.hub in names and all(ns in names for ns in net.node_namespaces)
        assert len(net.node_namespaces) == 2
        result = net.run([sys.executable, "-c", NODES], timeout=50, echo=(), cwd=str(ROOT),
                         env={"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONPATH": str(ROOT)})
    result.check()
    assert [n.ranks for n in result.nodes] == [[0, 1], [2, 3]]
    for r in result.ranks:
        out = json.loads(r.output.split("RESULT ", 1)[1].splitlines()[0])
        node = r.rank // 2
        assert out["env"] == {
            "RANK": str(r.rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(r.rank % 2), "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": str(node), "NODE_RANK": str(node), "GROUP_WORLD_SIZE": "2",
            "GLOO_SOCKET_IFNAME": f"lbs{node}", "MASTER_ADDR": "10.213.0.1", "MASTER_PORT": str(net.port)}
        (itx, irx, ilo), (ctx, crx, _) = out["intra"], out["cross"]
        assert itx < 64 * 1024 and irx < 64 * 1024, f"intra-node bytes crossed the link: {out}"
        assert ilo >= 4 * 2**20, f"intra-node allreduce not on loopback: {out}"
        # both cross-node groups ({0,2}, {1,3}) use each node's link: 2 x 4 MB each way, plus headers
        assert ctx >= 8 * 2**20 and crx >= 8 * 2**20, out
        assert r.node == node and r.local_rank == r.rank % 2
    for n, (tx, rx) in zip(result.nodes, result.cross_node_bytes_per_node):
        assert tx >= 8 * 2**20 and rx >= 8 * 2**20 and n.counters.if_tx > 0
    assert net.prefix not in _namespaces(), "namespaces left behind"


@pytest.mark.slow
@needs_root
def test_nodes_teardown_on_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with Network(nodes=2, ranks_per_node=2) as net:
            assert all(ns in _namespaces() for ns in net.node_namespaces)
            raise RuntimeError("boom")
    assert net.prefix not in _namespaces()


@pytest.mark.slow
@needs_root
def test_timeout_kills_ranks_and_tears_down():
    with Network(2) as net:
        result = net.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1, echo=())
    assert result.timed_out and not result.ok and result.seconds < 15
    with pytest.raises(NetemError, match="timed out"):
        result.check()
    assert net.prefix not in _namespaces()


@pytest.mark.slow
@needs_root
def test_teardown_on_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with Network(2) as net:
            raise RuntimeError("boom")
    assert net.prefix not in _namespaces()


@pytest.mark.slow
@needs_root
def test_sigterm_tears_down():
    """SIGTERM to a harness mid-run: ranks killed, namespaces removed, exit status 128+15."""
    script = textwrap.dedent("""
        import sys
        from benchmarks.harness.netem import Network
        with Network(2) as net:
            print(net.prefix, flush=True)
            net.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=50, echo=())
    """)
    harness = subprocess.Popen([sys.executable, "-c", script], cwd=str(ROOT), stdout=subprocess.PIPE, text=True)
    try:
        prefix = harness.stdout.readline().strip()
        assert prefix.startswith("lbs") and prefix in _namespaces()
        harness.send_signal(signal.SIGTERM)
        assert harness.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()
    assert prefix not in _namespaces()
