"""BitDP on a model sharded inside each node (FSDP2): its own hook on each unit's gradient shard.

FSDP2's per-unit all-reduce hook hands over the unit's flat, padded gradient shard after the
node's reduce-scatter (the node's mean): every parameter of the unit in order, each taking
``ceil(d0 / L) x rest`` elements of which this rank's ``to_local()`` rows come first and the
padding (zeros) after. FSDP2 shards every parameter on dim 0, so the shard holds whole
rows of each weight matrix: BitDP's per-output-channel codes and scales of those rows are
exactly what the flat hook computes for a matrix of those rows (channels that are columns,
an HF ``Conv1D``'s, are coded over the rows this rank holds).

So the unit's shard is handed to :func:`~.hook.bitdp_hook` as one bucket (:class:`UnitBucket`)
whose split (:class:`~.hook.BucketSplit`) is made here from the local shapes: the quantized rows go
through BitDP's collective (all-gather or two-stage form) over the ranks holding the same
shard on every node (``state.process_group``), the full-precision rows through one exact
mean, the padding nowhere. The result, written back in place before FSDP makes the sharded
gradients from the buffer, is the flat algorithm's over N workers fed their node's mean
gradient, in the sharded layout. Residuals and server errors are kept per parameter name in
the local shape.

Iterations (the warm-up of ``start_iter`` plain means) are counted as backward passes: a
unit whose hook runs a second time starts a new one (DDP's hook counts by its last bucket,
which FSDP2 has no equivalent of).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lowbit_strategy.algorithms.bitdp.hook import BitDPState, BucketSplit, bitdp_hook
from lowbit_strategy.layout import local_view

__all__ = ["UnitBucket", "sharded_ready", "unit_mean", "unit_plan"]


class UnitBucket:
    """A unit's gradient shard as the part of ``dist.GradBucket`` BitDP's hook reads."""

    def __init__(self, index: int, buf: torch.Tensor, params: Sequence[torch.Tensor]):
        self._index, self._buf, self._params = index, buf, list(params)

    def buffer(self) -> torch.Tensor:
        return self._buf

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return False  # iterations are counted by :func:`sharded_ready`


def _padded(p: torch.Tensor, ranks_per_node: int) -> int:
    """Elements ``p`` takes in FSDP2's padded reduce-scatter output: ceil(d0 / L) rows."""
    if p.dim() == 0:
        return 1
    rows = -(-p.shape[0] // ranks_per_node)
    return rows * math.prod(p.shape[1:])


def unit_plan(state: BitDPState, params: Sequence[torch.Tensor], numel: int, ranks_per_node: int) -> BucketSplit:
    """The split of a unit's padded gradient shard of ``numel`` elements: each quantized
    parameter's local rows (as a matrix of the local shape) and runs of full-precision local
    elements; the padding is in neither."""
    quantized: list[tuple[int, tuple[int, ...], int]] = []
    full: list[tuple[int, int]] = []
    transposed: set[int] = set()
    offset = 0
    for p in params:
        info, local = state.params.get(id(p)), local_view(p)
        if info is None:
            raise RuntimeError(f"BitDP: a sharded parameter of shape {tuple(p.shape)} is not in the attached model")
        n = local.numel()
        if info.quantized and n:
            quantized.append((offset, tuple(local.shape), id(p)))
            if info.transposed:
                transposed.add(id(p))
        elif n and full and full[-1][0] + full[-1][1] == offset:
            full[-1] = (full[-1][0], full[-1][1] + n)
        elif n:
            full.append((offset, n))
        offset += _padded(p, ranks_per_node)
    if offset != numel:
        raise RuntimeError(
            f"BitDP sharded: the unit's gradient shard holds {numel} elements, its parameters' padded shards {offset}: "
            "every parameter of a unit must have a gradient at every step (FSDP2 leaves out the ones without)"
        )
    return BucketSplit(tuple(quantized), tuple(full), tuple(id(p) for p in params), frozenset(transposed))


def sharded_ready(
    state: BitDPState,
    units: dict[tuple[int, ...], int],
    seen: set[int],
    params: Sequence[torch.Tensor],
    flat: torch.Tensor,
    ranks_per_node: int,
) -> torch.futures.Future[torch.Tensor]:
    """One unit's shard through BitDP (module docstring); ``units``: the units' indices by their
    parameters, ``seen``: the units whose hook ran in this backward pass (updated here)."""
    index = units.setdefault(tuple(id(p) for p in params), len(units))
    if index in seen:  # a new backward pass
        seen.clear()
        state.iter += 1
    seen.add(index)
    return unit_mean(state, index, params, flat, ranks_per_node)


def unit_mean(
    state: BitDPState, index: int, params: Sequence[torch.Tensor], flat: torch.Tensor, ranks_per_node: int
) -> torch.futures.Future[torch.Tensor]:
    """Unit ``index``'s shard through BitDP's hook at ``state.iter`` (its split cached per unit)."""
    key, cache = tuple(id(p) for p in params), (index, flat.numel())
    cached = state.plans.get(cache)
    if cached is None or cached.param_ids != key:
        state.plans[cache] = unit_plan(state, params, flat.numel(), ranks_per_node)
    return bitdp_hook(state, UnitBucket(index, flat, params))  # type: ignore[arg-type]
