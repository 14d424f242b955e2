"""Bytes across nodes when one FSDP group spans every rank (``LowBitConfig.fsdp_shard="world"``):
FSDP's parameter all-gathers and its gradient reduce-scatter, exact or quantized
(:mod:`~lowbit_strategy.collectives.fsdp_reduce_scatter`), for a model that does not fit in one
node. The sharded layout with FSDP inside each node is :mod:`.sharded`'s.

N nodes of L ranks, W = N·L, ranks numbered node by node. A unit of parameters ``shapes`` has
``c = Σ ceil(d0/W)·numel/d0`` elements per rank (:func:`~.sharded.padded_shard_numel`
at W): its all-gather input and reduce-scatter output on every rank; the reduce-scatter input
is ``W·c``. Per call, with ``s`` the element size, ``row(c)`` one blockwise-coded row
(:func:`~lowbit_strategy.codecs.blockwise.row_bytes`: codes + one fp32 scale per 256):

==========================  ===============================  ==================================
call                        one rank sends (any peer)        a node's link carries (each way)
==========================  ===============================  ==================================
all-gather (ring)           ``(W-1)·c·s``                    ``(W-1)·c·s``: one ring edge
reduce-scatter, ring        ``(W-1)·c·s``                    ``(W-1)·c·s``: one ring edge
(NCCL)
reduce-scatter, gloo        ``ar(W·c·s)``                    ``ar(W·c·s) = 2(W-1)·c·s``
(an allreduce, then a
slice)
quantized, one hop          ``(W-1)·row(c)``                 ``L·(W-L)·row(c)``: the rows for
(flat all-to-all)                                            the other nodes' ranks
quantized, two hops (qgZ)   ``(N-1)·row(c)`` across,         ``L·(N-1)·row(c)``
                            ``(L-1)·N·c·s`` inside
==========================  ===============================  ==================================

``ar(B) = 2(W-1)·ceil(B/W)``. Gloo's ``reduce_scatter_tensor`` is an allreduce of the whole
input followed by a slice (torch's ``ProcessGroupGloo::reduce_scatter_tensor_coalesced``), so
on the CPU harness the exact reduce-scatter costs twice NCCL's ring: ``impl="gloo"`` counts
that, ``impl="ring"`` (the default, for projections) NCCL's.

**Per step** FSDP2 all-gathers every unit in forward and, with ``reshard_after_forward`` (the
default), again in backward — except the root, which FSDP2 never reshards after forward — and
reduce-scatters every unit once in backward. The "one rank sends" column is what a rank's
traffic log records (:attr:`WorldSends.logged`) when every call is logged: the quantized
reduce-scatter logs itself; FSDP's own calls need a recorder (the benchmark's). Units without
parameters of their own run neither.

**Time** (:func:`world_seconds`): ``rounds·α + 8·link bytes / bandwidth`` over the forward's
calls and the backward's, rounds as :mod:`.flat` counts them (allreduce ``2⌈log2 W⌉``,
ring ``⌈log2 W⌉``, all-to-all ``W-1`` per exchange, two per quantized call: codes, scales; two
hops at N). Codec time and the intra-node hop (NVLink) are not counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lowbit_strategy.codecs import blockwise
from lowbit_strategy.collectives import fsdp_reduce_scatter, wire
from lowbit_strategy.pricing.flat import rounds
from lowbit_strategy.pricing.nodes import Cluster
from lowbit_strategy.pricing.sharded import padded_shard_numel

__all__ = ["Call", "WorldSends", "all_gather_call", "reduce_scatter_call", "world_seconds", "world_sends"]

#: exact reduce-scatter dtypes -> element size
EXACT = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class Call:
    """One collective call: ``sent`` the bytes one rank sends (any peer), ``link`` the bytes on
    one node's link (each direction), ``node`` the bytes one rank sends inside its node (two
    hops' first), ``rounds`` its latency terms."""

    sent: int
    link: int
    node: int = 0
    rounds: int = 0

    def __add__(self, other: Call) -> Call:
        return Call(self.sent + other.sent, self.link + other.link, self.node + other.node, self.rounds + other.rounds)

    def __mul__(self, k: int) -> Call:
        return Call(self.sent * k, self.link * k, self.node * k, self.rounds * k)


NOTHING = Call(0, 0)


def all_gather_call(c: int, nodes: int, ranks_per_node: int, itemsize: int = 4) -> Call:
    """FSDP's ring all-gather of ``c`` elements per rank over all W ranks."""
    w = nodes * ranks_per_node
    sent = wire.all_gather_bytes(c * itemsize, w)
    return Call(sent, sent if nodes > 1 else 0, rounds=rounds(w))


def reduce_scatter_call(
    c: int,
    nodes: int,
    ranks_per_node: int,
    form: str = "fp32",
    *,
    two_hop: bool = False,
    impl: str = "ring",
    itemsize: int = 4,
) -> Call:
    """One reduce-scatter of ``c`` output elements per rank over all W ranks (module table):
    ``form`` ``fp32``/``bf16`` (exact, ``impl`` ``ring`` or ``gloo``) or ``int8``/``int4``/``int2``
    (:mod:`~lowbit_strategy.collectives.fsdp_reduce_scatter`, one hop or ``two_hop``; ``itemsize``
    the reduce dtype's, which the intra-node hop sends)."""
    n, per_node = nodes, ranks_per_node
    w = n * per_node
    if form in EXACT:
        s = EXACT[form]
        if impl == "gloo":
            sent = wire.allreduce_bytes(w * c * s, w)
            return Call(sent, sent if n > 1 else 0, rounds=2 * rounds(w))
        if impl != "ring":
            raise ValueError(f"impl must be 'ring' or 'gloo', got {impl!r}")
        sent = (w - 1) * c * s
        return Call(sent, sent if n > 1 else 0, rounds=rounds(w))
    bits = fsdp_reduce_scatter.BITS[form]
    row = sum(blockwise.row_bytes(c, bits))
    if two_hop and n > 1 and per_node > 1:
        node, sent = fsdp_reduce_scatter.reduce_scatter_bytes(c, w, bits, itemsize, n)
        return Call(sent, per_node * sent, node, rounds=2 * (n - 1))
    return Call((w - 1) * row, per_node * (w - per_node) * row, rounds=2 * (w - 1))


@dataclass(frozen=True)
class WorldSends:
    """One step of one FSDP group over every rank: the forward's all-gathers, the backward's
    (re-gathers and reduce-scatters), each a :class:`Call` summed over units."""

    forward: Call
    backward_gather: Call
    reduce_scatter: Call

    @property
    def total(self) -> Call:
        return self.forward + self.backward_gather + self.reduce_scatter

    @property
    def link(self) -> int:
        """Bytes on one node's link per step (each direction)."""
        return self.total.link

    @property
    def logged(self) -> int:
        """Bytes one rank sends per step to any peer: what its traffic logs record as network
        traffic when every call is logged (the same on every rank)."""
        return self.total.sent


def world_sends(
    units: Sequence[Sequence[Sequence[int]]],
    nodes: int,
    ranks_per_node: int,
    *,
    reduce_scatter: str = "fp32",
    two_hop: bool = False,
    impl: str = "ring",
    param_itemsize: int = 4,
    reduce_itemsize: int = 4,
    reshard_after_forward: bool = True,
    root: int = 0,
) -> WorldSends:
    """One training step (module docstring) of ``units`` (each unit's own parameter shapes;
    ``root`` the index of the root's: 0 in module order, as
    :func:`~lowbit_strategy.integrations.sharded.sharded_units` lists them), parameters
    all-gathered in ``param_itemsize`` bytes, gradients reduce-scattered as ``reduce_scatter``
    (:func:`reduce_scatter_call`)."""
    w = nodes * ranks_per_node
    fwd = bwd = rs = NOTHING
    root = root % max(1, len(units))
    for i, shapes in enumerate(units):
        if not shapes:
            continue
        c = padded_shard_numel(shapes, w)
        gather = all_gather_call(c, nodes, ranks_per_node, param_itemsize)
        fwd = fwd + gather
        if reshard_after_forward and i != root:  # FSDP2 keeps the root unsharded into backward
            bwd = bwd + gather
        rs = rs + reduce_scatter_call(
            c, nodes, ranks_per_node, reduce_scatter, two_hop=two_hop, impl=impl, itemsize=reduce_itemsize
        )
    return WorldSends(fwd, bwd, rs)


def _seconds(call: Call, cluster: Cluster) -> float:
    return call.rounds * cluster.inter_latency_us * 1e-6 + 8 * call.link / (cluster.inter_gbps * 1e9)


def world_seconds(sends: WorldSends, cluster: Cluster) -> tuple[float, float]:
    """α–β seconds across nodes of the step's ``(forward, backward)`` calls on ``cluster``
    (module docstring, "Time"); zero on one node."""
    if cluster.nodes == 1:
        return 0.0, 0.0
    return _seconds(sends.forward, cluster), _seconds(sends.backward_gather + sends.reduce_scatter, cluster)
