"""Cross-node bytes of one step of each sharded configuration, from the cost model
(:mod:`lowbit_strategy.pricing.sharded`): what :mod:`benchmarks.nodes.sharded_worker`
reports next to what it measured, what ``tests/integrations/test_sharded_bytes.py`` checks
the traffic logs against, and what :mod:`benchmarks.nodes.sharded` projects to clusters.

A configuration's step, per its ``kind`` (:data:`KINDS`):

* ``hsdp_fp32`` / ``hsdp_bf16``: FSDP2 inside the node, the gradient shards' mean across
  nodes by an all-reduce hook on every unit (fp32 / bf16 on the wire): HSDP;
* ``lion``: Lion Cub's exchange of update vectors at the step in its resolved mode (the
  warm-up: fp32), plus its step agreement over every rank;
* ``onebit_adam``: warm-up HSDP fp32 (the exact mean from the hook), then the compensated
  1-bit allreduce of the momenta at the step;
* ``turboquant``: warm-up HSDP fp32, then each bucket in its form (a local rank whose every
  bucket is ``fp32`` averages gradients from the hook instead: HSDP fp32 for that rank).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lowbit_strategy.pricing import sharded as cs

KINDS = ("hsdp_fp32", "hsdp_bf16", "lion", "onebit_adam", "turboquant")
Shape = tuple[int, ...]


@dataclass(frozen=True)
class ShardedModel:
    """The global shapes a sharded run is made of: ``shapes`` the optimizer's parameters in
    its order, ``units`` the parameters each FSDP unit manages itself."""

    shapes: tuple[Shape, ...]
    units: tuple[tuple[Shape, ...], ...]

    @property
    def numel(self) -> int:
        return sum(int(torch.Size(s).numel()) for s in self.shapes)

    @classmethod
    def of(cls, model: torch.nn.Module, params: Sequence[torch.Tensor] | None = None) -> ShardedModel:
        """From a ``fully_shard``-ed model (``params``: the optimizer's, default the model's)."""
        from lowbit_strategy.integrations.sharded import sharded_units

        params = list(model.parameters()) if params is None else list(params)
        units = tuple(tuple(tuple(p.shape) for p in ps) for _, ps in sharded_units(model))
        return cls(tuple(tuple(p.shape) for p in params), units)


def lion_collective(plan) -> str:
    """Lion Cub's resolved :class:`~lowbit_strategy.algorithms.lion_cub.mode.SyncMode` -> the
    cost model's collective name."""
    return f"lp{plan.bits}" if plan.mode == "lp" else plan.mode


def step_sends(
    kind: str,
    model: ShardedModel,
    nodes: int,
    ranks_per_node: int,
    *,
    warmup: bool = False,
    warmup_wire: str = "bf16",
    bucket_numel: int = 25 * 2**18,
    collective: str | Callable[[int], str] = "fp32",
    block: int | None = None,
    bits: int = 4,
    momentum_shapes: Sequence[Shape] = (),
    overlap: bool = True,
) -> cs.ShardedSends:
    """One step of configuration ``kind`` (module docstring) on ``model``: ``warmup`` the
    staged optimizers' and Lion Cub's full-precision warm-up, sent as ``warmup_wire``
    (``LowBitConfig.warmup_wire``); ``collective`` Lion Cub's mode
    (:func:`lion_collective`) or TurboQuant's form per bucket (a name of
    :data:`~lowbit_strategy.pricing.sharded.TURBOQUANT`'s values, or a
    function of the bucket's elements); ``block``: 1-bit Adam's ``scale_block`` or
    TurboQuant's; ``momentum_shapes``: Lion Cub's synchronized momenta on a step that syncs;
    ``overlap``: Lion Cub's exchange launched during backward, per FSDP unit (its default), or
    at the step (the section's ``overlap=False``)."""
    n, per_node = nodes, ranks_per_node
    exact = cs.hsdp_sends(model.units, n, per_node, itemsize=2 if kind == "hsdp_bf16" else 4)
    if kind in ("hsdp_fp32", "hsdp_bf16"):
        return exact
    if kind == "lion":
        mode = warmup_wire if warmup else collective
        if overlap:
            assert isinstance(mode, str)  # Lion Cub's mode is one name for every bucket
            sends = cs.launched_sends(mode, model.units, n, per_node)
        else:
            sends = cs.agreement_sends(len(model.shapes), n, per_node) + cs.optimizer_sends(
                mode, model.shapes, n, per_node, bucket_numel=bucket_numel, last_first=False
            )
        return sends + cs.momentum_sync_sends(momentum_shapes, n, per_node) if momentum_shapes else sends
    if kind not in ("onebit_adam", "turboquant"):
        raise ValueError(f"unknown configuration kind {kind!r}; use one of {KINDS}")
    if warmup:
        return cs.hsdp_sends(model.units, n, per_node, itemsize=2 if warmup_wire == "bf16" else 4)
    name = "compensated" if kind == "onebit_adam" else collective
    compressed = cs.optimizer_sends(
        name, model.shapes, n, per_node, bucket_numel=bucket_numel, last_first=True, block=block, bits=bits
    )
    if kind == "onebit_adam":
        return compressed
    pick = collective if callable(collective) else (lambda _: collective)
    per_rank = []
    for j in range(per_node):
        sizes = cs.local_buckets(model.shapes, per_node, j, bucket_numel, last_first=True)
        all_fp32 = bool(sizes) and all(pick(m) == "fp32" for m in sizes)
        per_rank.append(exact.buckets[j] if all_fp32 else compressed.buckets[j])
    return cs.ShardedSends(tuple(per_rank))
