"""The emulated-network harness (benchmarks/netem.py): a real gloo allreduce between two
namespaces over a shaped link, bytes counted on the wire, everything torn down after.

Needs root and iproute2 (CI runs as root); skipped otherwise. Pure parts (rate parsing,
qdisc arguments) are tested everywhere.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.netem import Link, Network, NetemError, parse_rate

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
        from benchmarks.netem import Network
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
