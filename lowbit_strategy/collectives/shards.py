"""Where a compressed collective's input comes from, and where its result goes back.

A communicator computes "a compressed mean of a flat buffer over a group"; a
:class:`ShardSpec` says which part of a bucket's flat buffer this rank puts into that
collective, over which group, and how the result becomes the bucket's again:

* :class:`Whole` — the flat form: every rank sends the whole bucket over every rank; the
  result is the bucket's.
* :class:`NodeShard` — the hierarchical DDP form (:mod:`.hierarchy`): the node's ranks hold
  the node's mean gradient, local rank j sends shard j (``Topology.shard``) over its
  cross-node group, and the node all-gathers the shards' results
  (``Topology.gather_async``).
* A sharded data path (FSDP2 inside a node) provides a spec whose input is already this
  rank's shard: it sends all of it across nodes and gathers nothing back.

**The non-finite verdict is agreed by the spec.** A step is skipped on every rank or on
none: the verdict a collective gives is the same on every rank *of its group*, but in the
hierarchical form that group is one local rank of every node. :class:`NodeShard` ORs the
verdicts of a node's shards inside the all-gather it runs anyway (one extra element); a
spec that gathers nothing runs one small MAX allreduce inside the node instead.

**An empty shard still takes part** (:func:`pad_empty`: one zero element, dropped after),
so every rank launches the same collectives in the same order and carries its flag.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.hierarchy import Topology

__all__ = ["LocalShard", "NodeShard", "ShardSpec", "Whole", "pad_empty", "spec_for", "take"]


def pad_empty(t: torch.Tensor) -> torch.Tensor:
    """``t``, or one zero element when ``t`` is empty: an empty shard still takes part in
    its collective (so collective order and flags stay the same on every rank)."""
    return t if t.numel() else t.new_zeros(1)


def _done(value) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


class ShardSpec(Protocol):
    """This rank's part of a bucket, the group it is synchronized over, and the way back."""

    #: the group of the compressed collective (the workers)
    group: Any
    #: the number of workers: ranks of :attr:`group`
    world_size: int
    #: every rank of the run (what setup agreements, e.g. codec timings, run over)
    everyone: Any

    def part(self, n: int, align: int = 64) -> tuple[int, int]:
        """``(lo, hi)``: the elements of an ``n``-element bucket this rank sends, in units of
        ``align`` (a scale block: blocks stay whole)."""
        ...

    def part_length(self, n: int, align: int = 64) -> int:
        """The longest part any rank sends of an ``n``-element bucket (what plans size for)."""
        ...

    def restore_async(
        self, part: torch.Tensor, n: int, traffic=None, flag: torch.Tensor | None = None, align: int = 64
    ) -> torch.futures.Future[tuple[torch.Tensor, torch.Tensor | None]]:
        """This rank's result ``part`` -> ``(the bucket's result, the verdict every rank that
        shares the bucket agrees on, or None without ``flag``)``; read after ``wait()``."""
        ...

    def describe(self) -> str:
        """One line for checkpoints and logs (a layout of another shape is recognised on load)."""
        ...

    def agree(self, bad: bool) -> bool:
        """A step's verdict (this rank's, read on the host once per step) -> the verdict every
        rank of the run acts on. Called once per step on every rank. Where every rank that
        must decide alike already sees the same verdict (its collectives carried it), this is
        the identity and costs nothing."""
        ...

    def agree_level(self, level: int) -> int:
        """:meth:`agree` for a small integer verdict (several verdicts by priority): the
        largest over the same ranks, as cheaply."""
        ...


class Whole:
    """The flat form: every rank sends the whole bucket over ``group``; nothing comes back."""

    def __init__(self, group=None):
        self.group = self.everyone = group
        self.world_size = g.world_size(group)

    def part(self, n: int, align: int = 64) -> tuple[int, int]:
        return 0, n

    def part_length(self, n: int, align: int = 64) -> int:
        return n

    def restore_async(self, part, n, traffic=None, flag=None, align=64):
        return _done((part, flag))

    def describe(self) -> str:
        return f"whole over {self.world_size} ranks"

    def agree(self, bad: bool) -> bool:
        return bad  # every rank holds the same buckets and sees every rank's verdict

    def agree_level(self, level: int) -> int:
        return level


class NodeShard:
    """The hierarchical DDP form: local rank j's shard of the node's (identical) bucket,
    across nodes over ``topology.inter``; the node all-gathers the shards' results, and the
    verdicts with them (module docstring)."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.group = topology.inter
        self.world_size = g.world_size(topology.inter)
        self.everyone = topology.group

    def part(self, n: int, align: int = 64) -> tuple[int, int]:
        return self.topology.shard(n, align)

    def part_length(self, n: int, align: int = 64) -> int:
        return self.topology.shard_length(n, align)

    def restore_async(self, part, n, traffic=None, flag=None, align=64):
        lo, hi = self.part(n, align)
        return self.topology.gather_async(part.reshape(-1)[: hi - lo], n, traffic, flag, align)

    def describe(self) -> str:
        return f"node shard {self.topology.local_rank} of {self.topology.ranks_per_node}, over {self.world_size} nodes"

    def agree(self, bad: bool) -> bool:
        return bad  # the node's gather ORed its shards' verdicts: every rank already agrees

    def agree_level(self, level: int) -> int:
        return level  # (verdicts of whole buckets, which every rank holds after the gather)


class LocalShard:
    """A sharded data path (FSDP2 inside each node): this rank already holds only its shard
    of every parameter (and the node's mean gradient of it, from FSDP's reduce-scatter), so
    all of a bucket of local tensors is its part, synchronized across nodes over
    ``replicate_group`` (the ranks holding the same shard on every node), and nothing comes
    back: the optimizer steps its shard and FSDP all-gathers the parameters at the next
    forward.

    The ranks of a node hold different shards, so their buckets (and even their number of
    buckets) differ: a step's verdict cannot ride on a per-bucket collective of the node.
    :meth:`agree` ORs it once per step over every rank (``everyone``: one one-element MAX
    allreduce), so a NaN in one rank's shard skips the step on every rank."""

    def __init__(self, replicate_group, node_group=None, everyone=None):
        self.group = replicate_group
        self.world_size = g.world_size(replicate_group)
        #: this node's ranks (the FSDP group): where a parameter's shards are, for statistics of
        #: whole parameters (:meth:`node_sum_`, :meth:`node_max_`)
        self.node = node_group
        #: the ranks that must skip a step together: every rank of the run (None: the world)
        self.everyone = everyone

    def part(self, n: int, align: int = 64) -> tuple[int, int]:
        return 0, n

    def part_length(self, n: int, align: int = 64) -> int:
        return n

    def restore_async(self, part, n, traffic=None, flag=None, align=64):
        return _done((part.reshape(-1)[:n], flag))

    def describe(self) -> str:
        return f"local shard across {self.world_size} nodes"

    def node_sum_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the node's ranks, in place (per-parameter statistics of shards,
        e.g. squared norms: the whole parameter's); every rank of the node calls it alike."""
        g.all_reduce_sum(t, self.node, "shard.node_sum")
        return t

    def node_max_(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` maximised over the node's ranks, in place."""
        g.all_reduce_max(t, self.node, "shard.node_max")
        return t

    def agree(self, bad: bool) -> bool:
        return bool(self.agree_level(int(bad)))

    def agree_level(self, level: int) -> int:
        flag = torch.tensor([level], dtype=torch.int32)
        g.all_reduce_max(flag, g.cpu_group(self.everyone), "shard.agree")  # a host value: a CPU group
        return int(flag.item())


def spec_for(group, topology: Topology | None) -> Whole | NodeShard:
    """The spec of a DDP run: :class:`NodeShard` in the hierarchical form, else :class:`Whole`."""
    if topology is not None and topology.hierarchical:
        return NodeShard(topology)
    return Whole(group)


def take(spec: ShardSpec, flat: torch.Tensor, align: int = 64) -> torch.Tensor:
    """This rank's part of ``flat`` under ``spec`` (a view; :func:`pad_empty` when empty)."""
    lo, hi = spec.part(flat.numel(), align)
    return pad_empty(flat[lo:hi])
