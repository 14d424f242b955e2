"""An optimizer's parameters as the synchronization sees them: built once, from local tensors.

A :class:`Layout` is made when a communicator is attached (never as a side effect of a
later call) from the optimizer's ``param_groups``: each parameter's slot (its index in
``param_groups`` order, its group, its name), and the fixed buckets its compressed
collectives use. Everything is sized by the *local* tensor a rank holds: under FSDP2 a
parameter is a ``DTensor`` whose ``numel()`` is the global size, while the rank holds and
synchronizes only ``to_local()`` (:func:`local_view`; torchao's optimizers follow a
``DTensor`` the same way). For a plain tensor the local view is the tensor itself, so the
DDP path is unchanged.

Buckets: parameter indices, last parameter first (the order backward produces gradients),
zero-element and frozen parameters left out, cut at ``bucket_numel`` elements
(:func:`lowbit_strategy.buckets.partition`). A bucket's compressed result depends on which
elements share a scale, so the buckets are fixed for the optimizer's life and the same on
every rank that holds the same local shapes.

Names: state in checkpoints is keyed by parameter names (``Layout.key_name``), so a
checkpoint says what it holds and a different model or layout is refused with the reason
rather than loaded by position. Without a model (an optimizer built on bare tensors) the
names are ``param<i>``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from lowbit_strategy import buckets

__all__ = ["Key", "Layout", "Slot", "dtensor_state_", "is_dtensor", "local_step", "local_view", "parameter_names"]

#: a bucket of a layout: the indices of its parameters in ``param_groups`` order
Key = tuple[int, ...]


def local_view(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: ``t.to_local()`` for a ``DTensor`` (FSDP2's
    sharded parameters and gradients), ``t`` itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``DTensor`` (without importing ``torch.distributed.tensor``)."""
    return callable(getattr(t, "to_local", None)) and hasattr(t, "device_mesh")


@contextmanager
def local_step(optimizer: torch.optim.Optimizer) -> Iterator[dict[int, torch.Tensor]]:
    """Run an optimizer step on the local shards of ``DTensor`` parameters (FSDP2).

    For the duration of the block every ``DTensor`` parameter in ``param_groups`` is replaced
    by its local tensor (which shares its storage: in-place updates land in the parameter),
    with the local gradient as its ``.grad``, and ``optimizer.state`` by the same state keyed
    by those local tensors, its ``DTensor`` entries by their local tensors. So the step's
    arithmetic, the layout's buckets and the collectives see plain tensors of the shard's
    size. On exit everything is put back; state created during the step in a parameter's
    local shape becomes a ``DTensor`` like its parameter (``DTensor.from_local`` with the
    parameter's mesh, placements, global shape and stride, as torchao's optimizers do), so
    ``torch.distributed.checkpoint``'s state-dict helpers save and reshard it. Yields
    ``id(local) -> parameter`` (to map selections made on the parameters). With no
    ``DTensor`` parameter it changes nothing."""
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    places: list[tuple[list, int, torch.Tensor]] = []  # (a group's params, index, the DTensor there)
    for group in optimizer.param_groups:
        params = group["params"]
        for k, p in enumerate(params):
            if is_dtensor(p):
                local = p.to_local()
                local.grad = None if p.grad is None else p.grad.to_local()
                swapped.append((p, local))
                places.append((params, k, p))
                params[k] = local
    if not swapped:
        yield {}
        return
    saved_state: Any = optimizer.state
    local_state: Any = type(saved_state)(dict)
    for p, local in swapped:
        if p in saved_state:
            local_state[local] = {k: local_view(v) for k, v in saved_state[p].items()}
    for p, st in saved_state.items():  # plain parameters keep theirs
        if not is_dtensor(p):
            local_state[p] = st
    optimizer.state = local_state
    try:
        yield {id(local): p for p, local in swapped}
    finally:
        for params, k, p in places:
            params[k] = p
        for p, local in swapped:
            local.grad = None
            st = local_state.get(local)
            if st is not None:
                saved_state[p] = {
                    k: _as_dtensor_like(v, p, local, saved_state.get(p, {}).get(k)) for k, v in st.items()
                }
        optimizer.state = saved_state


def dtensor_state_(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict`` of rank-local state saved as local shards (what
    :func:`~lowbit_strategy.rank_state.to_cpu` writes for ``DTensor`` state): every state
    tensor of its ``DTensor`` parameter's local shape becomes a ``DTensor`` like the
    parameter again, so ``torch.distributed.checkpoint`` sees sharded state. A no-op for
    plain parameters."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state.get(p)
            if st and is_dtensor(p):
                local = p.to_local()
                optimizer.state[p] = {k: _as_dtensor_like(v, p, local, None) for k, v in st.items()}


def _as_dtensor_like(v, p, local: torch.Tensor, before) -> object:
    """State value ``v`` of the step back in ``p``'s terms: the ``DTensor`` it was a local
    view of, or a new ``DTensor`` like ``p`` for a tensor of the local shape; anything else
    (a 0-d statistic, a flag) as it is."""
    if not isinstance(v, torch.Tensor) or is_dtensor(v) or tuple(v.shape) != tuple(local.shape) or v.dim() == 0:
        return v
    if before is not None and is_dtensor(before) and before.to_local() is v:
        return before
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False)


def parameter_names(module: torch.nn.Module | None) -> dict[int, str]:
    """``id(parameter) -> name`` for every parameter of ``module`` (tied ones: the first name)."""
    if module is None:
        return {}
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


@dataclass(frozen=True)
class Slot:
    """One parameter of the layout: its index in ``param_groups`` order, the tensor, its
    parameter group and its name."""

    index: int
    param: torch.Tensor
    group: dict
    name: str

    @property
    def local(self) -> torch.Tensor:
        """The parameter as this rank holds it (:func:`local_view`)."""
        return local_view(self.param)


class Layout:
    """Slots and fixed buckets of one optimizer's parameters (module docstring)."""

    def __init__(
        self, param_groups: Sequence[Mapping], bucket_numel: int, names: Mapping[int, str] | None = None
    ) -> None:
        names = names or {}
        self.slots: list[Slot] = []
        for group in param_groups:
            for p in group["params"]:
                i = len(self.slots)
                self.slots.append(Slot(i, p, group, names.get(id(p), f"param{i}")))  # type: ignore[arg-type]
        self._index_of = {id(s.param): s.index for s in self.slots}
        order = [s.index for s in reversed(self.slots) if s.param.requires_grad and s.local.numel()]
        numels = [self.slots[i].local.numel() for i in order]
        #: the buckets, in launch order: tuples of parameter indices
        self.buckets: list[Key] = [tuple(order[j] for j in idx) for idx in buckets.partition(numels, bucket_numel)]

    def index_of(self, p: torch.Tensor) -> int | None:
        """``p``'s index, or None when it is not one of the layout's parameters."""
        return self._index_of.get(id(p))

    def indices(self, params: Iterable[torch.Tensor]) -> set[int]:
        """The indices of those of ``params`` that belong to the layout."""
        return {i for i in (self._index_of.get(id(p)) for p in params) if i is not None}

    def numel(self, key: Key) -> int:
        """Elements this rank holds of bucket ``key``."""
        return sum(self.slots[i].local.numel() for i in key)

    def key_name(self, key: Key) -> str:
        """Bucket ``key`` by its parameters' names (checkpoint keys)."""
        return ",".join(self.slots[i].name for i in key)

    def describe(self) -> dict:
        """What a checkpoint records of the layout: each bucket's parameter names and the
        local shape of every parameter (a different layout is recognised on load)."""
        return {
            "buckets": [self.key_name(k) for k in self.buckets],
            "shapes": {s.name: tuple(s.local.shape) for s in self.slots},
        }

    def key_of_name(self) -> dict[str, Key]:
        """Checkpoint key -> bucket."""
        return {self.key_name(k): k for k in self.buckets}
