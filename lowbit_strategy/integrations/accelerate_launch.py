"""What the launcher started, for the Accelerate front ends: how many processes
(:func:`launched_world_size`), whether Accelerate would find a device backend for them
(:func:`has_device_backend`) and Accelerate's boolean environment flags (:func:`env_flag`).
:class:`~lowbit_strategy.integrations.accelerate.LowBitAccelerator` and the Hugging Face
``Trainer`` mixin read them to pass ``cpu=True`` when several processes were launched on a
machine without a GPU (else each would train alone, ``DistributedType.NO``)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["env_flag", "has_device_backend", "launched_world_size"]

#: accelerate.utils probes of the device backends its launcher would use instead of gloo
_DEVICE_PROBES = (
    "is_xpu_available",
    "is_npu_available",
    "is_mlu_available",
    "is_sdaa_available",
    "is_musa_available",
    "is_hpu_available",
    "is_neuron_available",
)


def env_flag(value: str | None) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def launched_world_size() -> int:
    """How many processes the launcher started (1 when not launched distributed)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    for var in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"):
        try:
            size = int(os.environ.get(var, "") or 0)
        except ValueError:
            continue
        if size:
            return size
    return 1


def has_device_backend() -> bool:
    """Whether Accelerate would find a device (and its collective backend) for several processes."""
    if torch.cuda.is_available():
        return True
    import accelerate.utils as au

    return any(getattr(au, name, lambda: False)() for name in _DEVICE_PROBES)
