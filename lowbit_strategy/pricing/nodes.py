"""Bytes across nodes: exact per-bucket bytes of every algorithm's collective, flat and in the
hierarchical form (:mod:`~lowbit_strategy.collectives.hierarchy`), and the α–β time of a bucket
on a cluster of nodes.

**Recorded bytes** (what a rank's :class:`~lowbit_strategy.collectives.wire.TrafficLog` holds,
:mod:`~lowbit_strategy.collectives.wire`'s formulas; the tests check them at P up to 16).
One bucket of ``n`` float32 elements, P ranks, ``f`` = 1
when a non-finite flag travels with it, ``c = ceil(n/(8P))`` (whole bytes of sign bits per
chunk), ``ar(B) = 2(P-1)·ceil(B/P)`` the ring allreduce of B bytes, ``k(m)`` packed code bytes
of m codes, ``nb(m) = ceil(m/block)``:

=========================  =======================================  ==========================
collective (name)          all-to-all + all-gather                  allreduce
=========================  =======================================  ==========================
``1bit`` (majority vote)   ``(P-1)(c+f) + (P-1)·c``                 —
``sign``, ``lpB`` (lanes)  —                                        ``ar(k_w(n+f))``, lane w
``fp32``, ``bf16``         —                                        ``ar(4(n+f))``, ``ar(2(n+f))``
``ddp``                    —                                        ``ar(4n)``
``compensated`` (1-bit     ``2(P-1)(c + 4·nb(8c))`` (one scale      —
Adam/LAMB)                 without ``block``)
``turboquant_allgather``   ``(P-1)(k(n) + 4·nb(n))``                —
``turboquant_two_stage``   ``2(P-1)(k(c') + 4·nb(c'))``, c' the     —
                           server chunk
BitDP (:func:`bitdp_sends`)  :func:`.flat.bitdp_bytes`        ``ar(4·full)``
=========================  =======================================  ==========================

**Hierarchical form**, N nodes of L ranks: local rank j sends shard j of the payload,
``m_j = hi - lo`` of :meth:`Topology.shard(n, align) <.hierarchy.Topology.shard>` (an empty
shard sends one element), over its cross-node group of N ranks: the flat formula at P = N for
``m_j`` elements. Inside the node every rank sends the node mean, ``2(L-1)·ceil(4n/L)``, and
the all-gather of the shards, ``(L-1)·4·(s + g)`` with ``s`` the shard length and ``g`` = 1
for the staged optimizers (their verdict rides along). BitDP splits rows, not elements
(:func:`bitdp_hierarchical_sends`). On one node nothing crosses and the algorithms stop after
the node mean.

**What crosses a node's link** (:meth:`Sends.link_bytes`, for projections; the TrafficLog
counts every byte of a flat run as network). Ranks are numbered node by node, so a flat ring
(allreduce, all-gather) crosses each node's link on one edge: one rank's traffic, not L. A
pairwise all-to-all sends ``(P-L)/(P-1)`` of each rank's bytes to other nodes: about L times
one rank's. In the hierarchical form every cross-node byte crosses: the node's link carries
the sum over its L local ranks. So the saving differs by collective: for an all-to-all about
L (``L(P-L)/P`` against ``(N-1)/N`` of the payload), for a ring all-gather ``(P-1)/(N-1)``
(the all-gather forms grow with the number of workers), and for a ring allreduce almost none
(``2(P-1)/P`` against ``2(N-1)/N``: what is saved there is the precision lost inside nodes).
The 2-nodes × 2-ranks benchmark (README) measured these ratios on emulated links.

**Time** (:func:`bucket_seconds`): α–β per bucket, the bottleneck being the node's link:
``rounds·α + 8·link bytes / bandwidth``, rounds as in :mod:`.flat` (allreduce
``2⌈log2 P⌉``, all-gather ``⌈log2 P⌉``, all-to-all ``P-1``); the hierarchical form adds its
node stages on the intra-node link (NVLink) and runs its cross-node rounds at N. Codec time is
not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lowbit_strategy.codecs import bits as lanes
from lowbit_strategy.collectives import wire
from lowbit_strategy.collectives.gathered import PayloadLayout
from lowbit_strategy.collectives.summed import lane_for
from lowbit_strategy.collectives.turboquant.common import turboquant_server_chunk_length
from lowbit_strategy.pricing.flat import bitdp_bytes, rounds

#: the collectives of :func:`bucket_sends`, as the module docstring's table names them
NAMES = ("1bit", "sign", "lpB", "fp32", "bf16", "ddp", "compensated", "turboquant_allgather", "turboquant_two_stage")
#: collectives whose node all-gather carries the shard's non-finite verdict (the staged optimizers)
_GATHER_FLAGGED = ("compensated", "turboquant_allgather", "turboquant_two_stage")


@dataclass(frozen=True)
class Sends:
    """Bytes one rank sends (= receives) in one bucket's cross-node collectives, by primitive."""

    allreduce: int = 0
    all_gather: int = 0
    all_to_all: int = 0

    @property
    def total(self) -> int:
        return self.allreduce + self.all_gather + self.all_to_all

    def __add__(self, other: Sends) -> Sends:
        return Sends(
            self.allreduce + other.allreduce, self.all_gather + other.all_gather, self.all_to_all + other.all_to_all
        )

    def link_bytes(self, world_size: int, ranks_per_node: int) -> float:
        """Bytes leaving one node when each of its L ranks sends this in a flat group of P
        ranks numbered node by node (module docstring): the ring primitives once, the
        all-to-all ``L·(P-L)/(P-1)`` times."""
        p, per_node = int(world_size), int(ranks_per_node)
        if p <= per_node:
            return 0.0
        return self.allreduce + self.all_gather + self.all_to_all * per_node * (p - per_node) / (p - 1)

    def rounds(self, world_size: int) -> int:
        """Latency terms (α) of the primitives used, as :mod:`.flat` counts them."""
        r = rounds(world_size)
        return 2 * r * bool(self.allreduce) + r * bool(self.all_gather) + (world_size - 1) * bool(self.all_to_all)


@dataclass(frozen=True)
class NodeSends:
    """One bucket in the hierarchical form: ``network[j]`` what local rank j sends across
    nodes, ``node`` what every rank sends inside its node (node mean + all-gather)."""

    network: tuple[Sends, ...]
    node: int

    @property
    def network_per_node(self) -> int:
        """Bytes leaving one node: all its local ranks' cross-node bytes."""
        return sum(s.total for s in self.network)

    @property
    def node_per_node(self) -> int:
        return self.node * len(self.network)


def _packed(n: int, lane_bits: int) -> int:
    return lanes.lane(lane_bits).packed_bytes(n)


def bucket_sends(
    name: str, n: int, world_size: int, *, flagged: bool = True, block: int | None = None, bits: int = 4
) -> Sends:
    """Bytes one rank sends for one flat bucket of ``n`` elements at ``world_size`` ranks.
    ``name``: one of :data:`NAMES` (``lpB``: a B-bit lane, e.g. ``lp8``; ``sign``: the lane
    that holds P); ``flagged``: a non-finite flag travels with the payload (Lion Cub's overlap
    path; the others carry none); ``block``: the scale block of ``compensated`` (None: one
    scale) and the codec block of TurboQuant (default 1024); ``bits``: TurboQuant's."""
    p, n, f = int(world_size), int(n), int(flagged)
    if p < 1 or n < 1:
        raise ValueError(f"world_size and n must be >= 1, got {world_size}, {n}")
    if p == 1:
        return Sends()
    c = -(-n // (8 * p))
    if name == "1bit":
        return Sends(all_to_all=(p - 1) * (c + f), all_gather=(p - 1) * c)
    if name == "sign" or (name.startswith("lp") and name[2:].isdigit()):
        fixed = None if name == "sign" else int(name[2:])
        lane = lane_for(p, 1, signed=name != "sign", lane_bits=fixed).bits
        return Sends(allreduce=wire.allreduce_bytes(_packed(n + f, lane), p))
    if name in ("fp32", "bf16", "ddp"):
        width, extra = (2, f) if name == "bf16" else (4, 0 if name == "ddp" else f)
        return Sends(allreduce=wire.allreduce_bytes(width * (n + extra), p))
    if name == "compensated":
        nb = -(-8 * c // block) if block else 1
        return Sends(
            all_to_all=(p - 1) * (c + 4 * nb * bool(block)), all_gather=(p - 1) * (c + 4 * nb + 4 * (not block))
        )
    if name in ("turboquant_allgather", "turboquant_two_stage"):
        tq_block, lane = block or 1024, 2 if bits == 2 else 4 if bits <= 4 else 8
        if name == "turboquant_allgather":
            return Sends(all_gather=(p - 1) * (_packed(n, lane) + 4 * -(-n // tq_block)))
        m = turboquant_server_chunk_length(n, p, tq_block)
        chunk = (p - 1) * (_packed(m, lane) + 4 * -(-m // tq_block))
        return Sends(all_to_all=chunk, all_gather=chunk)
    raise ValueError(f"unknown collective {name!r}; use one of {NAMES}")


def shard_size(n: int, ranks_per_node: int, align: int = 64) -> int:
    """``ceil(n/L)`` rounded up to a multiple of ``align``
    (:meth:`~lowbit_strategy.collectives.hierarchy.Topology.shard_length`)."""
    per_rank = -(-n // ranks_per_node)
    return -(-per_rank // align) * align


def shard_lengths(n: int, ranks_per_node: int, align: int = 64) -> list[int]:
    """Elements local rank j of a node sends across nodes, j = 0 … L-1
    (:meth:`~lowbit_strategy.collectives.hierarchy.Topology.shard`)."""
    size = shard_size(n, ranks_per_node, align)
    return [max(0, min(n, j * size + size) - min(n, j * size)) for j in range(ranks_per_node)]


def hierarchical_sends(
    name: str,
    n: int,
    nodes: int,
    ranks_per_node: int,
    *,
    align: int = 64,
    flagged: bool = True,
    block: int | None = None,
    bits: int = 4,
    itemsize: int = 4,
) -> NodeSends:
    """One bucket of ``n`` elements in the hierarchical form (module docstring): the node
    mean of the gradients, shard j across the N nodes by local rank j, the node's all-gather
    of the shards' results. ``align``: the algorithm's shard unit (Lion Cub 64, 1-bit
    Adam/LAMB its ``scale_block``, TurboQuant its ``block``); ``itemsize``: bytes per element
    of the bucket (the node mean and the all-gather move the bucket's dtype)."""
    per_node = int(ranks_per_node)
    mean = wire.allreduce_bytes(itemsize * n, per_node)
    if nodes == 1:  # one node: nothing crosses; the node mean is the result
        return NodeSends((Sends(),) * per_node, mean)
    shards = shard_lengths(n, per_node, align)
    network = tuple(bucket_sends(name, max(m, 1), nodes, flagged=flagged, block=block, bits=bits) for m in shards)
    size = shard_size(n, per_node, align)
    gather = wire.all_gather_bytes(itemsize * (size + (name in _GATHER_FLAGGED)), per_node)
    return NodeSends(network, mean + gather)


# ---- BitDP: rows, not elements ---------------------------------------------------------------
def bitdp_sends(
    form: str,
    shapes: Sequence[tuple[int, int]],
    full: int,
    world_size: int,
    *,
    bits: int = 2,
    flagged: bool = True,
    reduction: str = "mean",
    itemsize: int = 4,
) -> Sends:
    """One flat BitDP bucket (:func:`~lowbit_strategy.algorithms.bitdp.hook.bitdp_hook`):
    channel matrices ``shapes`` (rows = output channels) quantized, ``full`` elements
    allreduced at full precision; a bucket with no matrix is one mean allreduce."""
    p = int(world_size)
    if not shapes:
        return Sends(allreduce=wire.allreduce_bytes(itemsize * full, p))
    layout = PayloadLayout.of(shapes, bits)
    codes = bitdp_bytes(form, layout, p, flagged=flagged, reduction=reduction)
    fp = wire.allreduce_bytes(itemsize * full, p) if full else 0
    if form == "two_stage":  # reduce-scatter (all-to-all) and all-gather of equal records
        return Sends(allreduce=fp, all_to_all=codes // 2, all_gather=codes // 2)
    if reduction == "paper":
        scales = wire.allreduce_bytes(4 * (layout.rows + flagged), p)
        return Sends(allreduce=fp + scales, all_gather=codes - scales)
    return Sends(allreduce=fp, all_gather=codes)


def bitdp_hierarchical_sends(
    form: str,
    shapes: Sequence[tuple[int, int]],
    full: int,
    nodes: int,
    ranks_per_node: int,
    *,
    bits: int = 2,
    flagged: bool = True,
    itemsize: int = 4,
) -> NodeSends:
    """One BitDP bucket in the hierarchical form (:mod:`~lowbit_strategy.algorithms.bitdp.
    hierarchical`): local rank j quantizes rows ``[⌊jR/L⌋, ⌊(j+1)R/L⌋)`` of every matrix and
    allreduces slice j (``ceil(full/L)`` elements) of the full-precision runs across the N
    nodes; the node all-gathers the longest rank's result. On one node the node mean is the
    result: nothing else is sent."""
    per_node = int(ranks_per_node)
    numel = full + sum(r * c for r, c in shapes)
    if nodes == 1:
        return NodeSends(tuple(Sends() for _ in range(per_node)), wire.allreduce_bytes(itemsize * numel, per_node))
    size = -(-full // per_node)
    network, lengths = [], []
    for j in range(per_node):
        mine = [(b - a, c) for r, c in shapes for a, b in [(j * r // per_node, (j + 1) * r // per_node)] if b > a]
        lo, hi = min(full, j * size), min(full, (j + 1) * size)
        sends = Sends(allreduce=wire.allreduce_bytes(itemsize * (hi - lo), nodes) if hi > lo else 0)
        if mine:
            layout = PayloadLayout.of(mine, bits)
            codes = bitdp_bytes(form, layout, nodes, flagged=flagged)
            sends = sends + (
                Sends(all_to_all=codes // 2, all_gather=codes // 2) if form == "two_stage" else Sends(all_gather=codes)
            )
        network.append(sends)
        lengths.append(sum(r * c for r, c in mine) + hi - lo)
    node = wire.allreduce_bytes(itemsize * numel, per_node) + wire.all_gather_bytes(itemsize * max(lengths), per_node)
    return NodeSends(tuple(network), node)


# ---- time on a cluster -----------------------------------------------------------------------
@dataclass(frozen=True)
class Cluster:
    """N nodes of L ranks; the links between nodes (per node) and inside a node (per rank)."""

    nodes: int
    ranks_per_node: int
    inter_gbps: float
    inter_latency_us: float = 20.0
    #: NVLink 3 (A100): 300 GB/s per direction per GPU
    intra_gbps: float = 2400.0
    intra_latency_us: float = 5.0

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def bucket_seconds(sends: Sends | NodeSends, cluster: Cluster) -> float:
    """α–β seconds of one bucket on ``cluster`` (module docstring, "Time"): a flat
    :class:`Sends` (every rank's) bottlenecked by the node's link, or a :class:`NodeSends`:
    its node stages on the intra-node link, its cross-node collectives at N."""
    inter_bps, alpha = cluster.inter_gbps * 1e9, cluster.inter_latency_us * 1e-6
    p, per_node = cluster.world_size, cluster.ranks_per_node
    if isinstance(sends, Sends):
        if p <= per_node:  # one node: the ring runs on NVLink
            return sends.rounds(p) * cluster.intra_latency_us * 1e-6 + 8 * sends.total / (cluster.intra_gbps * 1e9)
        return sends.rounds(p) * alpha + 8 * sends.link_bytes(p, per_node) / inter_bps
    r = rounds(per_node)
    intra = 3 * r * cluster.intra_latency_us * 1e-6 + 8 * sends.node / (cluster.intra_gbps * 1e9)
    network_rounds = max(s.rounds(cluster.nodes) for s in sends.network)
    return intra + network_rounds * alpha + 8 * sends.network_per_node / inter_bps
