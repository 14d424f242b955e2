"""The staged communicators' rank-local state per bucket, named and versioned.

Each algorithm declares its bucket state as a dataclass of :class:`BucketState` (1-bit
Adam/LAMB: worker and server error; TurboQuant: worker and server error, scale EMA and the
form the bucket was synchronized with), so nothing is read by position and nothing is
guessed from a tensor's length.

Checkpoints (:func:`state_dict` / :func:`load_state_dict`) write format 2::

    {"format": 2, "world_size": N, "shard": "<the ShardSpec's description>",
     "layout": {"buckets": ["name,name", ...], "shapes": {name: local shape}},
     "buckets": {"name,name": {field: tensor or str}}}

keyed by parameter names (as BitDP's state is). Format 1 (positional tuples keyed by
``"3,2,1"`` index strings, no version), written before, is still read: its tuples are
named by :meth:`BucketState.from_tuple`. A state saved at another world size, another
shard or another bucket layout describes other chunks of other buffers: it is not loaded,
and the log says which of the three differed (error feedback restarts from zero, which
costs accuracy for a few steps, never correctness).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

import torch

from lowbit_strategy.layout import Key, Layout

logger = logging.getLogger(__name__)

FORMAT = 2


@dataclasses.dataclass
class BucketState:
    """One bucket's committed rank-local state; ``worker`` (the worker error, the length of
    this rank's part of the bucket) decides whether it fits a bucket."""

    worker: torch.Tensor

    #: format 1 stored the fields as a tuple in this order
    legacy_fields: ClassVar[tuple[str, ...]] = ("worker",)

    def tensors(self) -> list[torch.Tensor]:
        return [v for v in vars(self).values() if isinstance(v, torch.Tensor)]

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is one of the state's buffers (it must not be recycled)."""
        return any(x is t for x in self.tensors())

    def fits(self, flat: torch.Tensor) -> bool:
        """Whether this state belongs to a bucket part like ``flat`` (length and device)."""
        return self.worker.numel() == flat.numel() and self.worker.device == flat.device

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()}

    @classmethod
    def from_dict(cls, d: dict, device) -> BucketState:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown or names - set(d):
            raise ValueError(f"{cls.__name__}: a saved bucket state holds {sorted(d)}, expected {sorted(names)}")
        return cls(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in d.items()})

    @classmethod
    def from_tuple(cls, values: tuple, device) -> BucketState:
        """A format-1 state (a positional tuple)."""
        return cls(**{k: v.to(device) for k, v in zip(cls.legacy_fields, values)})


def state_dict(errors: dict[Key, BucketState], layout: Layout | None, world_size: int, shard: str) -> dict:
    """Format 2 of a communicator's per-bucket state (module docstring)."""
    name = layout.key_name if layout is not None else (lambda k: ",".join(map(str, k)))
    return {
        "format": FORMAT,
        "world_size": world_size,
        "shard": shard,
        "layout": layout.describe() if layout is not None else None,
        "buckets": {name(k): v.to_dict() for k, v in errors.items()},
    }


def load_state_dict(
    state: dict, cls: type[BucketState], layout: Layout | None, world_size: int, shard: str, device, label: str
) -> dict[Key, BucketState]:
    """The per-bucket state of :func:`state_dict`'s output (or of format 1), or ``{}`` with
    a logged reason when it was saved for other buffers."""
    if state.get("world_size", world_size) != world_size:
        return _afresh(label, f"it was saved at world size {state.get('world_size')}, the run has {world_size}")
    version = state.get("format", 1)
    if version == 1:
        return {
            tuple(int(i) for i in k.split(",")): cls.from_tuple(tuple(v), device)
            for k, v in state.get("errors", {}).items()
        }
    if version != FORMAT:
        raise ValueError(f"{label} state has format {version!r}; this version reads formats 1 and {FORMAT}")
    if state.get("shard") != shard:
        return _afresh(label, f"it was saved for {state.get('shard')!r}, this rank holds {shard!r}")
    if layout is None:
        keys = {k: tuple(int(i) for i in k.split(",")) for k in state["buckets"]}
    else:
        if state.get("layout") is not None and state["layout"] != layout.describe():
            return _afresh(label, "it was saved for another bucket layout (other parameters, shapes or bucket size)")
        keys = layout.key_of_name()
    out = {}
    for name, saved in state["buckets"].items():
        if name not in keys:
            raise ValueError(f"{label} state holds bucket {name!r}, which the run's layout does not have")
        out[keys[name]] = cls.from_dict(saved, device)
    return out


def _afresh(label: str, reason: str) -> dict:
    logger.warning("lowbit: %s state not loaded, %s: error feedback starts afresh", label, reason)
    return {}
