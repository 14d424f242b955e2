"""Nodes: a fast link inside, a slow one between. Compress only what crosses nodes.

A cluster of N nodes with L ranks each (NVLink inside a node, a network between nodes) is
badly served by a flat group of P = N·L ranks: the algorithm compresses traffic between GPUs
of one node, which is nearly free and loses precision for nothing, and every rank's payload
goes through its node's network card, so a node pushes about L times what one worker would.
The hierarchical form (as DeepSpeed ZeRO++'s qgZ and Horovod's hierarchical allreduce do it)
makes **the node the worker**:

1. an exact reduction inside the node, in the bucket's dtype: every rank of the node holds
   the node's mean gradient (:meth:`Topology.node_mean_`), so the algorithm's local state
   (momenta, errors) evolves identically on the node's L ranks;
2. the algorithm's own compressed collective *across* nodes, on 1/L of the payload per local
   rank: local rank j sends shard j over the *cross-node group* j (local rank j of every
   node: L independent groups of N ranks, used in parallel), so each node sends every
   element once (:meth:`Topology.shard`);
3. an all-gather inside the node of the L shards' results (:meth:`Topology.gather_async`).

The result equals the flat algorithm run with N workers that each see their node's mean
gradient, shard by shard. Cross-node bytes per node are those of the flat algorithm at N
workers (1/L of the flat algorithm at P for the reduce-scatter forms, less still for the
all-gather forms, whose bytes grow with the number of workers); with one node nothing
crosses the network and the algorithm equals its uncompressed optimizer.

Node identity comes from the launcher (torchrun's ``GROUP_RANK``, Lightning's ``NODE_RANK``),
not from host names, and L from ``LOCAL_WORLD_SIZE`` (torchrun, Accelerate) or a front end's
hint (Lightning's devices per node), unless ``LowBitConfig.ranks_per_node`` sets it (a value
other than the launcher's redefines the nodes as rank blocks of that size). Nodes must
be contiguous blocks of equal size (node k holds ranks k·L … k·L + L - 1): anything else is a
:class:`~lowbit_strategy.validation.ConfigError` raised on every rank.

Intra-node collectives record their bytes with scope ``"node"``
(:attr:`~.wire.TrafficLog.node_bytes_sent`), apart from the bytes that cross the network.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lowbit_strategy.collectives import chain
from lowbit_strategy.collectives import group as g
from lowbit_strategy.validation import ConfigError

__all__ = ["Topology", "resolve", "launcher_layout"]

#: environment variables naming the launcher's node rank, in order of preference
NODE_RANK_VARIABLES = ("GROUP_RANK", "NODE_RANK")


@dataclass(frozen=True, eq=False)
class Topology:
    """How the P ranks of ``group`` sit on nodes, and the groups the hierarchical form uses.

    ``hierarchical`` False: the flat form (``intra``/``inter`` None; the algorithm runs over
    ``group``). True: ``intra`` holds this node's L ranks, ``inter`` local rank
    ``local_rank`` of every node (N ranks)."""

    group: Any  # the world (data-parallel) group: agreements, checkpoints
    world_size: int
    ranks_per_node: int
    node: int
    local_rank: int
    hierarchical: bool = False
    intra: Any = None
    inter: Any = None

    @property
    def nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    def describe(self) -> str:
        form = "hierarchical" if self.hierarchical else "flat"
        return f"{form}: {self.nodes} node(s) x {self.ranks_per_node} rank(s)"

    # ---- the three stages ------------------------------------------------------------
    def node_mean_(self, buf: torch.Tensor, traffic=None) -> None:
        """Replace ``buf`` by its mean over this node's ranks, in place, in its own dtype
        (stage 1), as DDP averages: scaled by 1/L, then summed (so one node of P ranks gives
        DDP's mean bit for bit). A no-op in the flat form. Blocking on the host only on gloo:
        on NCCL ``wait()`` orders the compute stream after the collective and returns."""
        if not self.hierarchical or self.ranks_per_node == 1:
            return
        buf.mul_(1.0 / self.ranks_per_node)
        g.all_reduce_sum_async(buf, self.intra, "node.mean", traffic).wait()

    def shard(self, n: int, align: int = 64) -> tuple[int, int]:
        """``(lo, hi)``: the elements of an ``n``-element payload this local rank sends
        across nodes (stage 2). Shards are ``shard_length(n, align)`` long, in local-rank
        order, the last ones shorter or empty: a deterministic split every rank computes
        alike. The flat form owns everything. ``align``: the algorithm's unit (its scale
        block): aligned shards keep every block whole, so a blocked codec gives the same
        codes as in the whole bucket."""
        if not self.hierarchical:
            return 0, n
        size = self.shard_length(n, align)
        lo = min(n, self.local_rank * size)
        return lo, min(n, lo + size)

    def shard_length(self, n: int, align: int = 64) -> int:
        """ceil(n / L) rounded up to a multiple of ``align``."""
        per_rank = -(-n // self.ranks_per_node)
        return -(-per_rank // align) * align

    def gather_async(
        self, part: torch.Tensor, n: int, traffic=None, flag: torch.Tensor | None = None, align: int = 64
    ) -> torch.futures.Future[tuple[torch.Tensor, torch.Tensor | None]]:
        """Stage 3: every local rank's ``part`` (its shard's result, ``shard(n, align)`` long)
        all-gathered inside the node into the full ``n``-element result. ``flag``: this
        rank's 0-d bool verdict on its shard (e.g. "non-finite"), which travels with it: the
        result's second item is the node's OR of them, so every rank of the node decides
        alike. A future resolving to ``(result, flag or None)``, chained from the
        all-gather's own (read it after ``wait()``)."""
        if not self.hierarchical:
            done: torch.futures.Future[tuple[torch.Tensor, torch.Tensor | None]] = torch.futures.Future()
            done.set_result((part, flag))
            return done
        size, flagged = self.shard_length(n, align), flag is not None
        block = part.new_zeros(size + flagged)
        block[: part.numel()] = part
        if flag is not None:
            block[size] = flag.to(block.dtype)
        out = part.new_empty((size + flagged) * self.ranks_per_node)
        fut = g.all_gather_async(out, block, self.intra, "node.all_gather", traffic)

        def assemble(f: torch.futures.Future) -> tuple[torch.Tensor, torch.Tensor | None]:
            rows = f.value().view(self.ranks_per_node, size + flagged)
            result = rows[:, :size].reshape(-1)[:n]
            return result, (rows[:, size] != 0).any() if flagged else None

        return chain.then(fut, assemble)


def launcher_layout(environ: Mapping[str, str] | None = None) -> tuple[int | None, int | None]:
    """``(ranks per node, node rank)`` as the launcher exported them, None where it did not."""
    env = os.environ if environ is None else environ

    def read(name: str) -> int | None:
        value = env.get(name, "").strip()
        if not value:
            return None
        try:
            return int(value)
        except ValueError:  # (an environment variable, not a config field)
            raise ConfigError(
                name, value, "the launcher exported a non-integer: unset it or fix the launcher"
            ) from None

    node = next((v for v in (read(n) for n in NODE_RANK_VARIABLES) if v is not None), None)
    return read("LOCAL_WORLD_SIZE"), node


_GROUPS: dict[tuple[Any, int], tuple[list[Any], list[Any]]] = {}


def _subgroups(world: int, per_node: int) -> tuple[list[Any], list[Any]]:
    """Every node's group and every local rank's cross-node group, made once per default
    group and layout (``new_group`` is a collective call: every rank makes every group, in
    the same order)."""
    key = (dist.group.WORLD, per_node)
    if key not in _GROUPS:
        nodes = world // per_node
        intra = [dist.new_group(list(range(k * per_node, (k + 1) * per_node))) for k in range(nodes)]
        inter = [dist.new_group(list(range(j, world, per_node))) for j in range(per_node)]
        for grp in intra:
            g.mark_node_local(grp)
        _GROUPS[key] = intra, inter
    return _GROUPS[key]


def resolve(config, group=None, ranks_per_node_hint: int | None = None, environ=None) -> Topology:
    """The run's :class:`Topology` from ``config.topology`` / ``config.ranks_per_node``, the
    launcher's environment and a front end's hint; a collective over ``group`` (every rank
    calls it, at setup). An impossible layout, or ranks that see different ones, raises the
    same :class:`~lowbit_strategy.validation.ConfigError` on every rank."""
    world = g.world_size(group) if dist.is_available() and dist.is_initialized() else 1
    rank = g.rank(group) if world > 1 else 0
    if group is not None and world != dist.get_world_size():
        # a subgroup of the world: its ranks are not the launcher's, so it has no nodes (flat)
        return Topology(group, world, world, 0, rank)
    env_l, env_node = launcher_layout(environ)
    per_node = config.ranks_per_node or env_l or ranks_per_node_hint or world
    # the launcher's node rank describes the launcher's nodes: an explicit ranks_per_node
    # other than the launcher's redefines them (node = rank // L)
    launcher_nodes = per_node == (env_l or ranks_per_node_hint or per_node)
    node = env_node if launcher_nodes and env_node is not None else rank // max(per_node, 1)
    if world > 1:
        mine = [int(per_node), int(node), rank]
        seen: list[Any] = [None] * world
        dist.all_gather_object(seen, mine, group=g.cpu_group(group))
    else:
        seen = [[per_node, node, rank]]
    problem = _layout_problem(seen, world, config)
    if problem:
        raise ConfigError("ranks_per_node", per_node, problem)
    hierarchical = {
        "flat": False,
        "hierarchical": True,
        "auto": world // per_node >= 2 and per_node >= 2,
    }[config.topology]
    if not hierarchical or world == 1:
        return Topology(group, world, per_node, node, rank % per_node)
    intra, inter = _subgroups(world, per_node)
    return Topology(group, world, per_node, node, rank % per_node, True, intra[node], inter[rank % per_node])


def _layout_problem(seen: list, world: int, config) -> str | None:
    """Why the ranks' ``[ranks per node, node rank, rank]`` cannot form equal contiguous
    nodes, or None. Every rank computes it from the same gathered list."""
    sizes = sorted({s[0] for s in seen})
    fix = (
        "set LowBitConfig.ranks_per_node (LOWBIT_RANKS_PER_NODE) to the ranks of one node, the same on "
        "every rank, or topology='flat'"
    )
    if len(sizes) > 1:
        return f"the ranks disagree on the ranks per node ({sizes}): {fix}"
    per_node = sizes[0]
    if per_node > world or world % per_node:
        return f"{per_node} ranks per node do not divide the world of {world} ranks into equal nodes: {fix}"
    wrong = [s[2] for s in seen if s[1] != s[2] // per_node]
    if wrong and config.topology != "flat":
        return (
            f"nodes must be contiguous rank blocks (node k holds ranks k*{per_node} .. k*{per_node}+{per_node - 1}), "
            f"but the launcher's node rank of rank(s) {wrong[:8]} says otherwise: launch with torchrun "
            f"--node-rank K on node K (ranks are numbered node by node), or {fix}"
        )
    return None
