"""Bytes across nodes in the sharded layout: FSDP2 inside each node, one collective per local
rank across nodes (:func:`lowbit_strategy.attach_sharded`), and HSDP's plain all-reduce.

N nodes of L ranks; ``fully_shard`` over the node gives local rank j the rows
``[j·c, min((j+1)·c, d0))`` of every parameter, ``c = ceil(d0/L)`` (:func:`local_shape`;
the last ranks' shards may be shorter or empty). Local rank j runs the *flat* collective
over the N ranks holding the same shard (``mesh["replicate"]``), on its local shards only;
the L local ranks run theirs side by side, so **a node's link carries the sum over its L
ranks** (every byte they send crosses: their peers are on other nodes). Per step and local
rank j, with :func:`~.nodes.bucket_sends` the flat bucket formula at P = N:

* **HSDP**, fp32 or bf16 (``itemsize`` 4 or 2; also the staged optimizers' warm-up, which
  averages gradients from FSDP's all-reduce hook, and TurboQuant's all-``fp32`` form): per
  FSDP unit, a ring allreduce of the unit's reduce-scatter output, which is padded to whole
  rows on every rank: ``ar(itemsize · Σ_params ceil(d0/L)·(numel/d0))`` (:func:`hsdp_sends`);
* **the optimizer's exchange** (:func:`optimizer_sends`): buckets of rank j's non-empty
  local shards cut at ``bucket_numel`` (:func:`lowbit_strategy.buckets.partition`), in the
  optimizer's order — the staged optimizers' :class:`~lowbit_strategy.layout.Layout`
  (last parameter first, launched during backward as each completes, or at the step),
  Lion Cub's step (parameter order, with ``overlap=False``) — each bucket of n elements
  sending ``bucket_sends(collective, n, N)`` with no non-finite flag; Lion Cub's default
  launches one flagged bucket per FSDP unit during backward (:func:`launched_sends`).
  ``collective``: Lion Cub's mode (``1bit``, ``sign``, ``lpB``, ``fp32``, ``bf16``; its
  warm-up ``warmup_wire``), 1-bit Adam's ``compensated`` with
  ``block`` = its ``scale_block``, TurboQuant's ``turboquant_allgather`` /
  ``turboquant_two_stage`` / ``fp32`` with its ``block`` and ``bits``;
* Lion Cub also agrees, every step it exchanges at the step, which parameters have a
  gradient and whether any rank saw NaN/Inf: one int32 SUM allreduce over **every** rank
  (P = N·L) of k + 1 elements for k parameters, ``ar(4(k+1))`` at P (:func:`agreement_sends`;
  launched during backward, the verdicts ride in the flags); with momentum sync, on the
  steps it runs, ``ar(4·m_j)`` at N for the m_j local elements of the selected momenta
  (nothing when m_j = 0; :func:`momentum_sync_sends`);
* the staged optimizers agree their step's verdict with a one-element MAX allreduce over
  every rank (:class:`~lowbit_strategy.collectives.shards.LocalShard`), which is not recorded (4 bytes).

These are exactly the bytes ``sync.traffic_logs()`` records as network traffic
(``tests/integrations/test_sharded_bytes.py`` checks them on 2 nodes × 2 ranks, step by
step). FSDP's own reduce-scatter and all-gather stay inside the node and are not counted.

**Time** (:func:`sharded_seconds`): ``rounds·α + 8·bytes per node / bandwidth``; the local
ranks' collectives run at once, so the latency is the longest rank's sum of its buckets'
rounds at N (:meth:`~.nodes.Sends.rounds`). Codec time and overlap are not counted (the planner
hides the launched exchange behind backward unit by unit: :mod:`lowbit_strategy.plan.predict_sharded`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lowbit_strategy import buckets
from lowbit_strategy.collectives import wire
from lowbit_strategy.pricing.nodes import Cluster, Sends, bucket_sends

Shape = tuple[int, ...]

#: TurboQuant's forms -> :func:`~.nodes.bucket_sends` names
TURBOQUANT = {"allgather": "turboquant_allgather", "two_stage": "turboquant_two_stage", "bf16": "bf16", "fp32": "fp32"}


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def local_shape(shape: Sequence[int], ranks_per_node: int, local_rank: int) -> Shape:
    """The part of a parameter of ``shape`` that local rank ``local_rank`` holds under
    ``fully_shard`` over L ranks: dim-0 rows ``[j·c, min((j+1)·c, d0))``, ``c = ceil(d0/L)``
    (a 0-d parameter is held whole)."""
    if not shape:
        return ()
    d0 = int(shape[0])
    c = -(-d0 // ranks_per_node)
    rows = max(0, min(d0, (local_rank + 1) * c) - min(d0, local_rank * c))
    return (rows, *(int(d) for d in shape[1:]))


def padded_shard_numel(shapes: Sequence[Sequence[int]], ranks_per_node: int) -> int:
    """Elements of one FSDP unit's reduce-scatter output (what its all-reduce hook gets, the
    same on every rank): each parameter padded to ``ceil(d0/L)`` rows."""
    total = 0
    for shape in shapes:
        if not shape:
            total += 1
            continue
        total += -(-int(shape[0]) // ranks_per_node) * (_numel(shape) // max(1, int(shape[0])))
    return total


@dataclass(frozen=True)
class ShardedSends:
    """One step across nodes: ``buckets[j]`` the cross-node collectives of local rank j, in order."""

    buckets: tuple[tuple[Sends, ...], ...]

    @property
    def network(self) -> tuple[int, ...]:
        """Bytes each local rank sends across nodes."""
        return tuple(sum(s.total for s in mine) for mine in self.buckets)

    @property
    def network_per_node(self) -> int:
        """Bytes on one node's link (each direction): the sum over its local ranks."""
        return sum(self.network)

    def __add__(self, other: ShardedSends) -> ShardedSends:
        if len(self.buckets) != len(other.buckets):
            raise ValueError(f"ranks per node differ: {len(self.buckets)} and {len(other.buckets)}")
        return ShardedSends(tuple(a + b for a, b in zip(self.buckets, other.buckets)))

    def rounds(self, nodes: int) -> int:
        """Latency terms of the slowest local rank (its buckets one after another)."""
        return max((sum(s.rounds(nodes) for s in mine) for mine in self.buckets), default=0)


def hsdp_sends(
    units: Sequence[Sequence[Sequence[int]]], nodes: int, ranks_per_node: int, itemsize: int = 4
) -> ShardedSends:
    """HSDP across nodes (module docstring): every local rank allreduces each unit's padded
    gradient shard over the N nodes, in ``itemsize``-byte elements (4: fp32, 2: bf16). Units
    without parameters run no hook."""
    per_unit = tuple(
        Sends(allreduce=wire.allreduce_bytes(itemsize * padded_shard_numel(u, ranks_per_node), nodes))
        for u in units
        if u
    )
    return ShardedSends((per_unit,) * ranks_per_node)


def local_buckets(
    shapes: Sequence[Sequence[int]], ranks_per_node: int, local_rank: int, bucket_numel: int, last_first: bool
) -> list[int]:
    """Elements of each bucket of local rank j's optimizer exchange (module docstring):
    its non-empty local shards, last parameter first when ``last_first`` (the staged
    optimizers' layout) or in parameter order (Lion Cub's step), cut at ``bucket_numel``."""
    numels = [_numel(local_shape(s, ranks_per_node, local_rank)) for s in shapes]
    numels = [n for n in (numels[::-1] if last_first else numels) if n]
    return [sum(numels[i] for i in idx) for idx in buckets.partition(numels, bucket_numel)] if numels else []


def optimizer_sends(
    collective: str | Callable[[int], str],
    shapes: Sequence[Sequence[int]],
    nodes: int,
    ranks_per_node: int,
    *,
    bucket_numel: int,
    last_first: bool,
    block: int | None = None,
    bits: int = 4,
) -> ShardedSends:
    """The optimizer's exchange at the step (module docstring): ``collective`` names each
    bucket's :func:`~.nodes.bucket_sends` collective, or maps a bucket's element
    count to it (TurboQuant's ``auto`` picks a form per bucket)."""
    pick = collective if callable(collective) else (lambda n: collective)
    per_rank = []
    for j in range(ranks_per_node):
        sizes = local_buckets(shapes, ranks_per_node, j, bucket_numel, last_first)
        per_rank.append(tuple(bucket_sends(pick(n), n, nodes, flagged=False, block=block, bits=bits) for n in sizes))
    return ShardedSends(tuple(per_rank))


def launched_sends(
    collective: str, units: Sequence[Sequence[Sequence[int]]], nodes: int, ranks_per_node: int
) -> ShardedSends:
    """Lion Cub's exchange started during backward (its ``overlap``, the default): one bucket
    per FSDP unit of rank j's non-empty local shards of the unit's parameters, each sending
    ``bucket_sends(collective, n, N)`` with its non-finite flag; the step then has no
    parameter left to agree on (no :func:`agreement_sends`). The staged optimizers launch
    their layout's buckets as they complete: :func:`optimizer_sends`' bytes either way."""
    per_rank = []
    for j in range(ranks_per_node):
        sizes = [sum(_numel(local_shape(s, ranks_per_node, j)) for s in unit) for unit in units]
        per_rank.append(tuple(bucket_sends(collective, n, nodes, flagged=True) for n in sizes if n))
    return ShardedSends(tuple(per_rank))


def agreement_sends(num_params: int, nodes: int, ranks_per_node: int) -> ShardedSends:
    """Lion Cub's step agreement: an int32 SUM allreduce of ``num_params + 1`` elements over
    every rank (P = N·L), on every local rank."""
    one = Sends(allreduce=wire.allreduce_bytes(4 * (num_params + 1), nodes * ranks_per_node))
    return ShardedSends(((one,),) * ranks_per_node)


def momentum_sync_sends(shapes: Sequence[Sequence[int]], nodes: int, ranks_per_node: int) -> ShardedSends:
    """Lion Cub's momentum sync of the parameters of ``shapes`` on the steps it runs: local
    rank j averages its shards' momenta in fp32 over N (the same local rank of every node
    holds the same shapes: one holding none sends nothing, and neither do its peers)."""
    per_rank = []
    for j in range(ranks_per_node):
        m = sum(_numel(local_shape(s, ranks_per_node, j)) for s in shapes)
        per_rank.append((Sends(allreduce=wire.allreduce_bytes(4 * m, nodes)),) if m else ())
    return ShardedSends(tuple(per_rank))


def sharded_seconds(sends: ShardedSends, cluster: Cluster) -> float:
    """α–β seconds across nodes of one step (module docstring, "Time") on ``cluster``."""
    if cluster.nodes == 1:
        return 0.0
    alpha = cluster.inter_latency_us * 1e-6
    return sends.rounds(cluster.nodes) * alpha + 8 * sends.network_per_node / (cluster.inter_gbps * 1e9)
