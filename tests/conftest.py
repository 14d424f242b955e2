"""Hypothesis profiles: ``dev`` (default) explores new random examples on every run;
``ci`` (``HYPOTHESIS_PROFILE=ci``, set by .ci/run) derandomizes, so a landing is judged on
the same examples each time and a newly found counterexample shows up in development
first; ``thorough`` runs 20x the examples (before changing a codec). None has a
per-example deadline: on a loaded 2-core machine wall time says
nothing about correctness."""
import os
import tempfile

import pytest
import torch
from hypothesis import settings

# Triton on a machine without a GPU (CI): its kernels run in the CPU interpreter, which is
# chosen when triton is *first imported*, and many things import triton along the way
# (torch and its integrations do lazily). Set it for the whole session before any test
# imports anything, so the Triton codec tests (tests/codecs/test_turboquant_triton.py) see
# an interpreter-mode triton whatever ran before them. With a GPU the kernels compile.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# NCCL's completion semantics for every collective of the suite (lowbit_strategy.collectives.
# emulation): a collective's future completes when it is queued, its output holds poison until
# its own wait() or a then() chained from it; set before anything imports lowbit_strategy, and
# inherited by every process the tests launch. LOWBIT_EMULATE_NCCL=0 runs plain gloo instead.
os.environ.setdefault("LOWBIT_EMULATE_NCCL", "1")

# The link every `auto` plans for: the default `link_*: measure` would probe the loopback at each
# attach and plan for what a loaded machine gives that moment; pinned here (inherited by every rank
# the tests spawn) to the figures the fields defaulted to before, so plans are deterministic. The
# probe's own tests unset it (lowbit_strategy.pricing.link_probe.ASSUME_ENV).
os.environ.setdefault("LOWBIT_LINK_ASSUME", "1.0,50")

# inductor's on-disk cache, one per CPU kernel set torch runs (ATEN_CPU_CAPABILITY): its cache key
# leaves the capability out, and a kernel a native run cached served a later avx2 run zeros
# (lowbit_strategy.codecs.compiled now checks a chain's first call against eager, and would fall
# back: tests/codecs/test_compiled.py requires that it compiled). Inherited by every spawned rank.
_capability = os.environ.get("ATEN_CPU_CAPABILITY") or "native"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"torchinductor_lowbit_{_capability}"))

settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, database=None, print_blob=True)
settings.register_profile("thorough", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The Hugging Face overlay (``tests/examples/tiny_hf.py``) is on ``sys.path`` only for the
    test that asked for it: processes that later tests spawn inherit ``sys.path``, and with
    transformers importable torchmetrics imports it with every ``import lightning`` (~1 s each)."""
    import sys
    from pathlib import Path

    try:
        return (yield)  # fixtures' teardown first
    finally:
        overlay = str(Path(sys.prefix) / "hf-overlay")
        while overlay in sys.path:
            sys.path.remove(overlay)
