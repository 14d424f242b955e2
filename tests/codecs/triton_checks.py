"""What the Triton kernel tests share (``test_turboquant_triton.py``, ``test_signs_triton.py``,
``test_channel_triton.py``): the kernel module rebuilt for Triton's CPU interpreter, the
"triton is required" rule, bit-pattern equality, and the two checks that compile for a GPU in a
subprocess without the interpreter: on a CUDA device (``run_without_interpreter`` of a script that
prints ``ok``), and for an H100 without one (:func:`compile_sm90`, imported by such a script)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from types import ModuleType

import pytest
import torch


def import_interpreted(name: str) -> ModuleType:
    """``lowbit_strategy.codecs.<name>`` built for Triton's interpreter: ``TRITON_INTERPRET=1`` is
    set before it is (re)imported and left set for the rest of the process (triton imports parts
    of itself lazily at the first launch and reads the variable again then)."""
    os.environ["TRITON_INTERPRET"] = "1"
    module = importlib.import_module(f"lowbit_strategy.codecs.{name}")
    if module.AVAILABLE and not module.INTERPRETED:
        module = importlib.reload(module)  # rebuild for the interpreter
    return module


def need_triton(module: ModuleType) -> None:
    """Fail (skip with ``LOWBIT_ALLOW_NO_TRITON=1``) when triton does not import: the kernels
    would go untested."""
    if not module.AVAILABLE:
        if os.environ.get("LOWBIT_ALLOW_NO_TRITON") == "1":
            pytest.skip("triton is not installed (LOWBIT_ALLOW_NO_TRITON=1)")
        pytest.fail(
            'triton is not installed, so its kernels are untested: pip install -e ".[dev]" (or set '
            "LOWBIT_ALLOW_NO_TRITON=1 on a platform without triton wheels)",
            pytrace=False,
        )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bit patterns (tells -0.0 from 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def run_without_interpreter(source: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -c source`` with the kernels compiled for real (``TRITON_INTERPRET`` removed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=timeout)


def assert_ok_on_cuda(source: str) -> None:
    """Run a script that checks the compiled kernels on this machine's GPU and prints ``ok``."""
    r = run_without_interpreter(source)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr


def compiled_figures(source: str) -> dict:
    """The JSON a script compiling for an H100 prints last (no GPU needed)."""
    r = run_without_interpreter(source, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def compile_sm90(fn, signature: dict, constexprs: dict, sass: list[str] | None = None, **options) -> str:
    """The PTX of ``fn`` compiled for an H100 (sm_90; triton bundles ptxas, so no GPU is needed),
    with ``options`` (e.g. ``enable_fp_fusion``); with ``sass``, also appends its machine code
    (triton's bundled ``nvdisasm``). Called inside :func:`run_without_interpreter`'s scripts."""
    import tempfile

    import triton
    import triton.backends.nvidia
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **options})
    if sass is not None:
        nvdisasm = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", "nvdisasm")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            sass.append(subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout)
    return kernel.asm["ptx"]
