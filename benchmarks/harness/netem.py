"""Emulated network for multi-process benchmarks: one network namespace per rank (or per
node of several ranks), a bridge, ``tc``-shaped links, and the bytes that really crossed each link.

On one machine every rank talks over loopback, which hides what compression is for. This
harness gives each of P ranks its own network namespace ``<prefix>r<i>`` with one veth
interface (``lbs<i>``, address ``10.213.0.<i+1>/24`` by default: a private /24 that exists
only inside these namespaces). The other ends of the veths are ports of a Linux bridge in
a hub namespace ``<prefix>hub``. Each link is shaped in both directions (the rank's egress
and the hub port's egress towards the rank), like a full-duplex switch port:

* ``tbf`` at the given rate, or ``netem rate ... delay ...`` when a delay is asked for
  (needs the kernel's ``sch_netem``; this harness says so when it is missing);
* unshaped links get a ``pfifo`` so that their byte counters exist too.

**Nodes** (``Network(nodes=N, ranks_per_node=L, link=...)``, CLI ``--nodes N
--ranks-per-node L``): one namespace ``<prefix>node<k>`` per node, holding the L ranks
k*L ... k*L+L-1 (contiguous blocks, as torchrun numbers them), with one shaped veth
``lbs<k>`` (address ``10.213.0.<k+1>``) to the hub. The ranks of a node share that interface
address; their traffic with each other is addressed to it, and the kernel delivers a
packet for a local address over loopback: it never touches the veth or its qdiscs, so it
is unshaped and not counted. What the node's counters show is exactly the bytes that
crossed nodes. ``Network(P, link)`` is the per-rank form of before (N = P, L = 1).

Bytes are read two ways per rank, or per node (:class:`Counters`):

* ``if_tx`` / ``if_rx``: the veth's own counters (``ip -s link``). veth keeps TCP's
  segmentation offload, so one counted "packet" may be a 64 KiB super-frame with one set
  of headers: these bytes omit most per-frame header overhead;
* ``wire_tx`` / ``wire_rx``: the bytes of the root qdiscs that shape the link (the rank's
  egress, and the hub port's egress towards the rank). The kernel counts them as the
  frames that would be on an Ethernet wire (headers of every MTU-sized segment; no
  preamble, inter-frame gap or FCS), and they are what the shaper's rate limits. Use
  these for "bytes on the wire" and for physical time bounds.

Namespaces, veths and bridge are removed on normal exit, on exceptions, on Ctrl-C and on
SIGTERM/SIGHUP; every run is bounded by a timeout (:mod:`benchmarks.harness.procs`). Needs root.

Python::

    from benchmarks.harness.netem import Link, Network
    with Network(4, Link("100mbit")) as net:
        result = net.run(lambda rank: [sys.executable, "worker.py"], timeout=300)
    result.check()                      # raises with each failed rank's output tail
    print(result.ranks[0].counters.wire_tx)

    with Network(nodes=2, ranks_per_node=2, link=Link("1gbit")) as net:   # 2 nodes x 2 ranks
        result = net.run([sys.executable, "worker.py"], timeout=300).check()
    print(result.cross_node_bytes_per_node)   # [(wire_tx, wire_rx) of node 0, of node 1]

Each rank's command runs as ``ip netns exec <ns> CMD`` with ``MASTER_ADDR`` (node 0's
address), ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and
``GLOO_SOCKET_IFNAME`` (its node's veth) set, so ``init_process_group("gloo",
init_method="env://")`` works; ``LBS_*`` variables let the rank read its own (node's)
counters with :func:`rank_counters`. In the node form the rest of torchrun's set is there
too: ``LOCAL_RANK`` = rank - k*L, ``LOCAL_WORLD_SIZE`` = L, ``GROUP_RANK`` = ``NODE_RANK``
= k, ``GROUP_WORLD_SIZE`` = N, ``ROLE_RANK``/``ROLE_WORLD_SIZE``. The per-rank form keeps
its former variables unchanged (``LOCAL_RANK`` = ``RANK``, no node variables: one logical
node whose ranks happen to sit behind separate links).

CLI (``python -m benchmarks.harness.netem --help``)::

    python -m benchmarks.harness.netem -P 2 --rate 100mbit -- python -c 'import os; print(os.environ["RANK"])'
    python -m benchmarks.harness.netem --nodes 2 --ranks-per-node 2 --rate 1gbit -- python worker.py
    python -m benchmarks.harness.netem --cleanup    # namespaces left by a harness killed with -9
"""
from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import astuple, dataclass, field

from benchmarks.harness import procs

PREFIX = "lbs"
DEFAULT_SUBNET = "10.213.0"
DEFAULT_PORT = 29500
_NAME_RE = re.compile(rf"^{PREFIX}(\d+)n\d+(hub|r\d+|node\d+)$")
_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_sequence = itertools.count()


class NetemError(RuntimeError):
    """The emulated network could not be built, run or torn down."""


def parse_rate(rate: str) -> float:
    """Bits per second of a ``tc`` rate such as ``1gbit`` or ``100mbit`` (bit units only:
    tc's ``bps`` means *bytes* per second, a classic trap, so it is refused)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?bit)", rate.strip().lower())
    if not m:
        raise ValueError(f"link rate must look like 1gbit, 100mbit or 500kbit, got {rate!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass(frozen=True)
class Link:
    """One direction of every rank's link: ``rate`` (tc syntax, None = unshaped) and a
    one-way ``delay_ms`` (needs netem)."""

    rate: str | None = None
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.rate is not None:
            parse_rate(self.rate)
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")

    @property
    def bits_per_second(self) -> float | None:
        return None if self.rate is None else parse_rate(self.rate)

    @property
    def name(self) -> str:
        base = self.rate or "unshaped"
        return f"{base}+{self.delay_ms:g}ms" if self.delay_ms else base

    def qdisc(self) -> list[str]:
        """The ``tc qdisc replace dev X root ...`` arguments for this link."""
        if self.delay_ms:
            args = ["netem", "delay", f"{self.delay_ms}ms", "limit", "100000"]
            return args + (["rate", self.rate] if self.rate else [])
        if self.rate is None:
            return ["pfifo", "limit", "100000"]
        burst = self.burst_bytes
        return ["tbf", "rate", self.rate, "burst", str(burst), "limit", str(max(4 << 20, 4 * burst))]

    @property
    def burst_bytes(self) -> int:
        """tbf bucket: ~1 ms of traffic, at least 16 KiB (tbf cuts larger GSO frames itself).
        A full bucket lets a burst this large pass at once, so time bounds are loose for
        transfers of only a few milliseconds."""
        return 0 if self.rate is None else max(16 * 1024, int(parse_rate(self.rate) / 8 / 1000))


@dataclass(frozen=True)
class Counters:
    """Bytes a rank (a node) sent/received: interface counters and shaped-qdisc (wire) counters."""

    if_tx: int = 0
    if_rx: int = 0
    wire_tx: int = 0
    wire_rx: int = 0

    def __sub__(self, other: Counters) -> Counters:
        return Counters(*(a - b for a, b in zip(astuple(self), astuple(other))))


def _cmd(args: Sequence[str], check: bool = True) -> str:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NetemError(f"`{' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def _qdisc_bytes(netns: str, dev: str) -> int:
    for q in json.loads(_cmd(["tc", "-n", netns, "-s", "-j", "qdisc", "show", "dev", dev]) or "[]"):
        if q.get("root"):
            return int(q.get("bytes", 0))
    return 0


def read_counters(netns: str, ifname: str, hub: str, port: str) -> Counters:
    """Counters of rank interface ``ifname`` in ``netns`` whose bridge port is ``hub``/``port``."""
    stats = json.loads(_cmd(["ip", "-n", netns, "-s", "-j", "link", "show", "dev", ifname]))[0]["stats64"]
    return Counters(int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]),
                    _qdisc_bytes(netns, ifname), _qdisc_bytes(hub, port))


def rank_counters() -> Counters:
    """This rank's counters, from inside a command started by :meth:`Network.run`."""
    return read_counters(*(os.environ[k] for k in ("LBS_NETNS", "LBS_IFNAME", "LBS_HUB_NETNS", "LBS_HUB_PORT")))


def require_root() -> None:
    """Raise :class:`NetemError` unless running as root with ``ip`` and ``tc`` present."""
    if os.geteuid() != 0:
        raise NetemError(
            "the emulated network needs root (it creates network namespaces, veths and a bridge "
            "and shapes them with tc); run as root, e.g. `sudo -E env PATH=$PATH python -m ...`"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetemError(f"the emulated network needs iproute2; not found on PATH: {missing}")


@dataclass
class RankResult:
    """One rank's exit code, its merged stdout/stderr, and the bytes it moved: its node's
    link counters (the ranks of one node share its link, so they show the same counters)."""

    rank: int
    returncode: int | None
    output: str
    counters: Counters
    node: int = 0
    local_rank: int = 0


@dataclass
class NodeResult:
    """One node: its ranks and the bytes that crossed its shaped link during the run."""

    node: int
    ranks: list[int]
    counters: Counters

    @property
    def cross_node_bytes(self) -> tuple[int, int]:
        """(sent, received) on the wire: the shaping qdiscs' counters of this node's link."""
        return self.counters.wire_tx, self.counters.wire_rx


@dataclass
class RunResult:
    ranks: list[RankResult]
    seconds: float
    timed_out: bool = False
    link: Link = field(default_factory=Link)
    nodes: list[NodeResult] = field(default_factory=list)

    @property
    def cross_node_bytes_per_node(self) -> list[tuple[int, int]]:
        """Per node, (wire bytes sent, wire bytes received) over its link to the other nodes.
        Traffic between ranks of the same node is not in it (it stays on the node's loopback)."""
        return [n.cross_node_bytes for n in self.nodes]

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.returncode == 0 for r in self.ranks)

    def check(self) -> RunResult:
        """Raise :class:`NetemError` with each failed rank's output tail unless all succeeded."""
        if self.ok:
            return self
        why = "timed out" if self.timed_out else "failed"
        tails = "".join(
            f"\n--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}"
            for r in self.ranks if r.returncode != 0
        )
        raise NetemError(f"run {why} after {self.seconds:.1f}s{tails}")


class Network:
    """Namespaces on a shaped bridge; a context manager that always tears them down.

    ``Network(P, link)``: one namespace per rank (the per-rank form). ``Network(nodes=N,
    ranks_per_node=L, link=link)``: one namespace per node holding L ranks, nodes joined by
    the shaped links; ``Network(P, link, ranks_per_node=L)`` is the same with N = P / L.
    """

    def __init__(self, world_size: int | None = None, link: Link = Link(), *, nodes: int | None = None,
                 ranks_per_node: int | None = None, subnet: str = DEFAULT_SUBNET, port: int = DEFAULT_PORT,
                 mtu: int = 1500) -> None:
        #: the per-rank form (no node given): namespaces and variables exactly as before nodes existed
        self.per_rank = nodes is None and ranks_per_node is None
        per_node = 1 if ranks_per_node is None else ranks_per_node
        if per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
        if nodes is None:
            if world_size is None:
                raise ValueError("give world_size, or nodes (and ranks_per_node)")
            if world_size % per_node:
                raise ValueError(f"world_size {world_size} is not a multiple of ranks_per_node {per_node}")
            nodes = world_size // per_node
        elif world_size is not None and world_size != nodes * per_node:
            raise ValueError(f"world_size {world_size} != nodes {nodes} x ranks_per_node {per_node}")
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes (world_size in the per-rank form) must be in [1, 250], got {nodes}")
        if nodes * per_node > 4096:
            raise ValueError(f"at most 4096 ranks, got {nodes} x {per_node}")
        self.nodes, self.ranks_per_node, self.world_size = nodes, per_node, nodes * per_node
        self.link, self.subnet, self.port, self.mtu = link, subnet, port, mtu
        self.prefix = f"{PREFIX}{os.getpid()}n{next(_sequence)}"
        self.hub = f"{self.prefix}hub"
        self.node_namespaces = [f"{self.prefix}{'r' if self.per_rank else 'node'}{k}" for k in range(nodes)]
        #: rank -> its (node's) namespace
        self.namespaces = [self.node_namespaces[self.node_of(r)] for r in range(self.world_size)]
        self._created: list[str] = []
        self._old_handlers: dict[int, object] = {}
        self._tearing_down = False

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def ranks_of(self, node: int) -> list[int]:
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def node_ifname(self, node: int) -> str:
        return f"lbs{node}"

    def node_address(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def ifname(self, rank: int) -> str:
        """The interface of ``rank``'s node (the rank's own in the per-rank form)."""
        return self.node_ifname(self.node_of(rank))

    def address(self, rank: int) -> str:
        """The address of ``rank``'s node (shared by the ranks of a node)."""
        return self.node_address(self.node_of(rank))

    def env(self, rank: int) -> dict[str, str]:
        """Variables for rank ``rank``: torch.distributed's env:// set (torchrun's, in the node
        form) plus ``LBS_*``."""
        node = self.node_of(rank)
        env = {
            "MASTER_ADDR": self.node_address(0), "MASTER_PORT": str(self.port),
            "RANK": str(rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(rank),
            "GLOO_SOCKET_IFNAME": self.node_ifname(node), "LBS_NETNS": self.node_namespaces[node],
            "LBS_IFNAME": self.node_ifname(node), "LBS_HUB_NETNS": self.hub,
            "LBS_HUB_PORT": f"p{node}", "LBS_LINK": self.link.name,
            "LBS_LINK_BPS": str(self.link.bits_per_second or 0),
        }
        if not self.per_rank:
            env.update({
                "LOCAL_RANK": str(rank - node * self.ranks_per_node),
                "LOCAL_WORLD_SIZE": str(self.ranks_per_node), "GROUP_RANK": str(node), "NODE_RANK": str(node),
                "GROUP_WORLD_SIZE": str(self.nodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(self.world_size),
                "LBS_NODE": str(node), "LBS_NODES": str(self.nodes),
            })
        return env

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> Network:
        self._install_signal_handlers()
        atexit.register(self.down)
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def _add_netns(self, name: str) -> None:
        _cmd(["ip", "netns", "add", name])
        self._created.append(name)
        _cmd(["ip", "-n", name, "link", "set", "lo", "up"])

    def up(self) -> None:
        """Create the hub, the bridge, one namespace + veth per node (per rank in the per-rank
        form), and shape the links."""
        require_root()
        self._add_netns(self.hub)
        _cmd(["ip", "-n", self.hub, "link", "add", "br0", "type", "bridge"])
        _cmd(["ip", "-n", self.hub, "link", "set", "br0", "up"])
        for node, ns in enumerate(self.node_namespaces):
            self._add_netns(ns)
            port, dev = f"p{node}", self.node_ifname(node)
            _cmd(["ip", "-n", self.hub, "link", "add", port, "mtu", str(self.mtu), "type", "veth",
                  "peer", "name", dev, "mtu", str(self.mtu), "netns", ns])
            _cmd(["ip", "-n", self.hub, "link", "set", port, "master", "br0", "up"])
            _cmd(["ip", "-n", ns, "addr", "add", f"{self.node_address(node)}/24", "dev", dev])
            _cmd(["ip", "-n", ns, "link", "set", dev, "up"])
        self.set_link(self.link)

    def set_link(self, link: Link) -> None:
        """(Re)shape every node's link, both directions."""
        self.link = link
        for node, ns in enumerate(self.node_namespaces):
            for netns, dev in ((ns, self.node_ifname(node)), (self.hub, f"p{node}")):
                proc = subprocess.run(["tc", "-n", netns, "qdisc", "replace", "dev", dev, "root", *link.qdisc()],
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    hint = (" (this kernel lacks sch_netem: link delay cannot be emulated here; "
                            "use delay_ms=0)" if "netem" in link.qdisc() and "unknown" in proc.stderr else "")
                    raise NetemError(f"tc could not shape {netns}/{dev} as {link.name}: "
                                     f"{proc.stderr.strip()}{hint}")

    def down(self) -> None:
        """Delete every namespace this network created (their veths and bridge go with them)."""
        if self._tearing_down:
            return
        self._tearing_down = True
        try:
            for ns in reversed(self._created):
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            self._created.clear()
        finally:
            self._restore_signal_handlers()
            atexit.unregister(self.down)
            self._tearing_down = False

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals are delivered to the main thread only; try/finally still holds

        def interrupt(signum, frame):
            if not self._tearing_down:  # let a teardown in progress finish
                raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, interrupt)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    # -- running ---------------------------------------------------------------------------
    def node_counters(self) -> list[Counters]:
        """Each node's link counters, now (cumulative since the network was built)."""
        return [read_counters(ns, self.node_ifname(k), self.hub, f"p{k}") for k, ns in enumerate(self.node_namespaces)]

    def counters(self) -> list[Counters]:
        """Each rank's counters: its node's (the same for the ranks of one node)."""
        per_node = self.node_counters()
        return [per_node[self.node_of(r)] for r in range(self.world_size)]

    def run(self, command: Callable[[int], Sequence[str]] | Sequence[str], *, timeout: float = 600,
            env: dict[str, str] | None = None, echo: Sequence[int] = (0,), cwd: str | None = None,
            grace_s: float = 10.0) -> RunResult:
        """Run ``command`` (argv, or rank -> argv) in every rank's namespace and wait.

        Output lines of the ranks in ``echo`` are printed as they come (prefixed ``[rI]``).
        Past ``timeout`` seconds, or ``grace_s`` after the first rank fails, the remaining
        ranks are killed (:func:`benchmarks.harness.procs.launch`). Returns exit codes, output and
        counter deltas per rank and per node (:attr:`RunResult.cross_node_bytes_per_node`).
        """
        if not self._created:
            raise NetemError("Network.run called outside `with Network(...)` (nothing is set up)")
        argvs = [["ip", "netns", "exec", ns, *(command(r) if callable(command) else command)]
                 for r, ns in enumerate(self.namespaces)]
        envs = [{**os.environ, **(env or {}), **self.env(r), "PYTHONUNBUFFERED": "1"}
                for r in range(self.world_size)]
        before = self.node_counters()
        done = procs.launch(argvs, envs, timeout=timeout, echo=echo, cwd=cwd, grace_s=grace_s)
        after = self.node_counters()
        delta = [a - b for a, b in zip(after, before)]
        ranks = [RankResult(r, code, out, delta[self.node_of(r)], self.node_of(r), r % self.ranks_per_node)
                 for r, (code, out) in enumerate(zip(done.returncodes, done.outputs))]
        nodes = [NodeResult(k, self.ranks_of(k), delta[k]) for k in range(self.nodes)]
        return RunResult(ranks, done.seconds, done.timed_out, self.link, nodes)


def run_ranks(world_size: int | None, link: Link, command, *, nodes: int | None = None,
              ranks_per_node: int | None = None, **kwargs) -> RunResult:
    """Build a network, run ``command`` on every rank (see :meth:`Network.run`), tear down."""
    with Network(world_size, link, nodes=nodes, ranks_per_node=ranks_per_node) as net:
        return net.run(command, **kwargs)


def leftover_namespaces(only_dead: bool = True) -> list[str]:
    """Namespaces named by this harness (``lbs<pid>n<k>...``), by default of dead processes only."""
    names = [line.split()[0] for line in _cmd(["ip", "netns", "list"]).splitlines() if line.strip()]
    matches = [(name, _NAME_RE.match(name)) for name in names]
    return [name for name, m in matches if m and not (only_dead and os.path.exists(f"/proc/{m.group(1)}"))]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.harness.netem", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-P", "--world-size", type=int, default=None,
                        help="ranks, each in its own namespace (default 2; with --nodes: N x L)")
    parser.add_argument("--nodes", type=int, default=None,
                        help="N nodes: one namespace per node, joined by the shaped links")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="L ranks per node, sharing its namespace (default 1; ranks k*L..k*L+L-1 on node k)")
    parser.add_argument("--rate", default=None, help="link rate in tc syntax, e.g. 1gbit, 100mbit (default: unshaped)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per link (needs sch_netem)")
    parser.add_argument("--timeout", type=float, default=600, help="kill the ranks after this many seconds")
    parser.add_argument("--echo", default="0", help="comma-separated ranks whose output is shown live (default 0)")
    parser.add_argument("--cleanup", action="store_true", help="delete namespaces left by dead harness processes")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS... run in every rank's namespace")
    args = parser.parse_args(argv)
    try:
        require_root()
        if args.cleanup:
            for name in leftover_namespaces():
                _cmd(["ip", "netns", "del", name], check=False)
                print(f"deleted {name}")
            return 0
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            parser.error("give a command after --")
        echo = [int(r) for r in args.echo.split(",") if r.strip()]
        world_size = 2 if args.world_size is None and args.nodes is None and args.ranks_per_node is None \
            else args.world_size
        try:
            network = Network(world_size, Link(args.rate, args.delay_ms), nodes=args.nodes,
                              ranks_per_node=args.ranks_per_node)
        except ValueError as err:
            parser.error(str(err))
        with network as net:
            result = net.run(command, timeout=args.timeout, echo=echo)
    except (NetemError, KeyboardInterrupt) as err:
        print(f"netem: {str(err) or 'interrupted; ranks killed, namespaces removed'}", file=sys.stderr)
        return 2 if isinstance(err, NetemError) else 130
    if network.per_rank:
        for r, c in ((r, r.counters) for r in result.ranks):
            print(f"rank {r.rank}: exit {r.returncode}; wire tx {c.wire_tx} B rx {c.wire_rx} B; "
                  f"interface tx {c.if_tx} B rx {c.if_rx} B")
    else:
        for n, c in ((n, n.counters) for n in result.nodes):
            codes = ", ".join(f"rank {r} exit {result.ranks[r].returncode}" for r in n.ranks)
            print(f"node {n.node} ({codes}): cross-node wire tx {c.wire_tx} B rx {c.wire_rx} B; "
                  f"interface tx {c.if_tx} B rx {c.if_rx} B")
    print(f"{result.link.name}: {result.seconds:.2f}s{' (timed out)' if result.timed_out else ''}")
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
