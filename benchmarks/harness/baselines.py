"""The DDP baselines users would run instead of this package, as Lightning strategies on CPU.

Every benchmark that compares against DDP (:mod:`benchmarks.e2e.driver`, :mod:`benchmarks.nodes.driver`,
:mod:`benchmarks.ttq.driver`, :mod:`benchmarks.quality.driver` through ``examples/gpt_lion.py``) builds
them here, so that "DDP bf16" means the same thing everywhere:

* ``ddp``: DDP's fp32 allreduce (no hook);
* ``bf16``: torch's own ``default_hooks.bf16_compress_hook`` (cast each bucket to bfloat16,
  divide by the world size, allreduce in bf16, cast back): half the bytes of fp32. DDP
  refuses that hook *by its name* outside NCCL/XCCL ("requires CUDA 11+ and NCCL 2.10+");
  gloo reduces bf16 correctly, and :class:`HookedDDP` registers every hook through a
  counting wrapper of another name, so torch's unmodified function runs;
* ``fp16``: torch's ``fp16_compress_hook`` (the same bytes as bf16, fp16 range);
* ``powersgd``: torch's ``powerSGD_hook`` with :data:`POWERSGD` (rank 4, error feedback,
  warm start, and torch's own default warm-up of ``start_powerSGD_iter`` steps of fp32
  allreduce), registered on the DDP model; not a reimplementation;
* ``local``: no gradient crosses the wire (calibration runs: compute time alone).

Lightning registers DDP comm hooks on CUDA only; :class:`HookedDDP` registers them on any
device.
"""
from __future__ import annotations

import inspect

from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from lowbit_strategy import keep_local_gradients

#: torch's defaults of ``PowerSGDState`` (read, not copied: they follow the installed torch)
POWERSGD_DEFAULTS = {name: p.default for name, p in inspect.signature(powerSGD_hook.PowerSGDState).parameters.items()
                     if p.default is not inspect.Parameter.empty}
#: what the PowerSGD baseline runs with: rank 4, everything else torch's default
POWERSGD = {"matrix_approximation_rank": 4,
            **{k: POWERSGD_DEFAULTS[k] for k in ("start_powerSGD_iter", "use_error_feedback", "warm_start",
                                                  "min_compression_rate")}}
#: hook kinds -> what the hook is (for reports)
HOOKS = {
    "ddp": "fp32 allreduce (no hook)",
    "bf16": "torch's bf16_compress_hook (via a wrapper: DDP refuses it by name on gloo)",
    "fp16": "torch's fp16_compress_hook",
    "powersgd": "torch's powerSGD_hook",
    "local": "lowbit_strategy.keep_local_gradients (nothing crosses the wire)",
}


def powersgd_settings(start_iter: int | None = None) -> dict:
    """:data:`POWERSGD`, with another fp32 warm-up length where a benchmark needs one (a
    timing window past it; a short quick run)."""
    return {**POWERSGD, **({} if start_iter is None else {"start_powerSGD_iter": int(start_iter)})}


class HookedDDP(DDPStrategy):
    """DDPStrategy that registers a comm hook on any device (Lightning's does on CUDA only).

    ``make_state`` is called once the process group exists. The hook is wrapped to count
    its calls (the wrapper is unannotated, so DDP's signature check passes it through; its
    name is not one DDP refuses on gloo).

    ``serialize``: before a bucket's hook starts, wait until the previous bucket's future is
    done. torch's ``powerSGD_hook`` issues its 2nd and 3rd allreduce from future callbacks;
    on gloo those run on the backend's threads, so with two DDP buckets the collectives of
    bucket 0's tail and bucket 1's head reach gloo in a rank-dependent order and the run
    aborts (``gloo::EnforceNotMet ... Received data size doesn't match expected size``).
    DDP calls the hooks in bucket order on every rank, so waiting makes the order the same.
    The wait happens when bucket 1 is ready, i.e. at the end of the backward pass: bucket
    0's communication still overlaps the backward pass.
    """

    def __init__(self, hook, make_state=lambda: None, serialize: bool = False, **kwargs):
        super().__init__(**kwargs)
        self._hook, self._make_state, self._serialize, self.hook_calls = hook, make_state, serialize, 0
        self._previous = None
        self.hook_state = None

    def configure_ddp(self) -> None:
        super().configure_ddp()

        def counted(state, bucket):
            self.hook_calls += 1
            if self._serialize and self._previous is not None:
                self._previous.wait()
            fut = self._hook(state, bucket)
            self._previous = fut if self._serialize else None
            return fut

        self.hook_state = self._make_state()
        self.model.register_comm_hook(self.hook_state, counted)


def make_baseline(kind: str, powersgd_start: int | None = None) -> DDPStrategy:
    """The Lightning strategy of baseline ``kind`` (a key of :data:`HOOKS`)."""
    if kind == "ddp":
        return DDPStrategy()
    if kind == "bf16":
        return HookedDDP(default_hooks.bf16_compress_hook)
    if kind == "fp16":
        return HookedDDP(default_hooks.fp16_compress_hook)
    if kind == "powersgd":
        settings = powersgd_settings(powersgd_start)
        return HookedDDP(powerSGD_hook.powerSGD_hook,
                         lambda: powerSGD_hook.PowerSGDState(process_group=None, **settings), serialize=True)
    if kind == "local":
        return HookedDDP(keep_local_gradients)
    raise ValueError(f"unknown baseline {kind!r}; choose from {sorted(HOOKS)}")
