"""Part 1: the Triton kernels compiled for this GPU, bit-exact against the torch codecs,
without ``TRITON_INTERPRET``:

* ``tests/codecs/test_turboquant_triton.py``: ``test_cuda_bit_exact`` (TurboQuant's kernels
  against the torch codec over bit widths, block sizes, lengths, dtypes and scales) and
  ``test_compiled_ptx_rounds_like_torch`` (IEEE division and square root, no flush-to-zero,
  no FMA in the sm_90 PTX);
* ``tests/codecs/test_signs_triton.py``: ``test_cuda_bit_exact`` (the fused 1-bit decode,
  server mean, compress and majority vote against the torch codes) and ``test_compiled_ptx_has_no_fma``;
* ``tests/codecs/test_channel_triton.py``: ``test_cuda_bit_exact`` (BitDP's fused channel encode
  against the torch code on the GPU, GPT-2's shapes) and ``test_compiled_ptx_rounds_like_torch``."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks.gpu_check import ROOT, Part

TESTS = ("tests/codecs/test_turboquant_triton.py", "tests/codecs/test_signs_triton.py", "tests/codecs/test_channel_triton.py")


def run(args) -> Part:
    part = Part("kernels", "1. Triton kernels on this GPU, bit-exact against the torch codec")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOWBIT_EMULATE_NCCL")}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    # the two tests that compile for the device (the interpreter's tests are CI's)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, "-m", "slow or not slow",
           "-k", "test_cuda_bit_exact or test_compiled_ptx"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    print("\n".join(tail[-15:]), flush=True)
    last = tail[-1] if tail else "(no output)"
    part.data = {"returncode": proc.returncode, "summary": last}
    part.markdown = f"`pytest {' '.join(TESTS)}` without the interpreter: {last}"
    if proc.returncode != 0 or f"{2 * len(TESTS)} passed" not in last:  # a skip is not a pass
        part.failures.append(f"{' '.join(TESTS)}: {last}")
    return part
