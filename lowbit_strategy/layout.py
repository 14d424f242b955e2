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
(:func:`lowbit_strategy.buckets.plan`). A bucket's compressed result depends on which
elements share a scale, so the buckets are fixed for the optimizer's life and the same on
every rank that holds the same local shapes.

Names: state in checkpoints is keyed by parameter names (``Layout.key_name``), so a
checkpoint says what it holds and a different model or layout is refused with the reason
rather than loaded by position. Without a model (an optimizer built on bare tensors) the
names are ``param<i>``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from lowbit_strategy import buckets

__all__ = ["Key", "Layout", "Slot", "local_view", "parameter_names"]

#: a bucket of a layout: the indices of its parameters in ``param_groups`` order
Key = tuple[int, ...]


def local_view(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: ``t.to_local()`` for a ``DTensor`` (FSDP2's
    sharded parameters and gradients), ``t`` itself otherwise."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


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
        self.buckets: list[Key] = [tuple(order[j] for j in idx) for idx in buckets.plan(numels, bucket_numel)]

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
