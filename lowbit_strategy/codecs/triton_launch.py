"""What every Triton codec module shares: the optional import, the interpreter mode, the
launch options and the device guard.

- ``triton`` / ``tl``: the modules, or None where ``triton`` is not installed
  (``pip install "lowbit-strategy[triton]"``); :data:`AVAILABLE`, :data:`IMPORT_ERROR`.
- :func:`interpret_mode`: whether Triton runs kernels in its numpy interpreter
  (``TRITON_INTERPRET=1``, read at each module's import: a process runs either interpreted or
  compiled kernels).
- :data:`LAUNCH`: the options of every launch. ``enable_fp_fusion=False``: no FMA contraction,
  so a kernel rounds each multiply and add as torch does (bit-exact with the torch backends).
- :func:`on_device`: launch on a tensor's GPU, not the current one.
"""

from __future__ import annotations

import contextlib
import os

import torch

try:  # optional dependency: the codecs work without it (backend="torch")
    import triton
    import triton.language as tl
except ImportError as _err:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    IMPORT_ERROR: ImportError | None = _err
else:
    IMPORT_ERROR = None

#: whether ``triton`` could be imported
AVAILABLE = triton is not None

#: every kernel launch's options: no floating-point fusion (FMA), so the bits match torch's
LAUNCH = {"enable_fp_fusion": False}


def interpret_mode() -> bool:
    """Whether Triton would run kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    if not AVAILABLE:
        return False
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # older triton: the environment variable
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def on_device(t: torch.Tensor):
    """Launch on ``t``'s GPU, not the current one: a plain-DDP script that never calls
    ``torch.cuda.set_device`` would otherwise launch on cuda:0 with pointers on cuda:rank."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
