"""``make gpu-check`` (``python -m benchmarks.gpu_check --out DIR``): what only a GPU can show.

The project's CUDA behaviour is established on CPU by construction (NCCL's completion
semantics emulated, the Triton kernels in the interpreter). The first GPU machine it meets
often has one GPU, so this check does not need more: NCCL refuses two ranks on one GPU, but
gloo runs its collectives on CUDA tensors (pinned host buffers, CUDA streams and events), so
several gloo ranks sharing the GPU run the real CUDA path: kernels queued asynchronously,
copies on side streams, futures that complete before the data is read unless the stream
rules are kept. Parts, each a module here with a ``run(args) -> Part``:

1. :mod:`.kernels`: the TurboQuant Triton kernels compiled for this GPU, bit-exact against
   the torch codec (``tests/codecs/test_turboquant_triton.py`` without the interpreter);
2. :mod:`.codec_speed`: every codec's encode and decode at 2^24 and 2^26 elements, eager and
   compiled, in GB/s and as a fraction of a device-to-device copy of the same bytes; writes
   the codec timings ``lowbit-plan`` reads (:data:`CODECS_JSON`);
3. :mod:`.ranks`: 2 and 4 processes on the one GPU (backend ``cpu:gloo,cuda:gloo``), every
   algorithm through plain DDP and Lightning, flat and as 2 nodes x 2: replicas identical,
   loss falling, within tolerance of the same run on CPU, a NaN on one rank skips the step
   on every rank, no host reads during backward;
4. :mod:`.where_time`: a GPT-2-small-shaped model's step, each algorithm's codec time for its
   buckets, the step time projected against DDP fp32 and bf16 at 10-400 Gbit/s, and the
   link speed above which each algorithm stops paying on this GPU.

``--cpu`` runs parts 3 and 4 on CPU (gloo, small sizes) with the same report, so CI checks
the script itself. Writes ``report.md`` and ``report.json`` to ``--out``; exits non-zero on
any failure.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
#: where ``lowbit-plan`` looks for a GPU's codec times (``lowbit_strategy.plan.cli.GPU_CODECS``)
CODECS_JSON = ROOT / "benchmarks" / "results" / "gpu" / "codecs.json"


@dataclasses.dataclass
class Part:
    """One part's outcome: ``markdown`` is its section of ``report.md`` (tables), ``data``
    its JSON-able figures in ``report.json``, ``failures`` one line per failed check (empty
    when it passed)."""

    name: str
    title: str
    markdown: str = ""
    data: dict = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures


def write_codecs(ns_per_element: dict[str, float], device: str, path: Path = CODECS_JSON) -> dict:
    """Write codec nanoseconds per element (``measure_codecs``' keys) in the format
    ``lowbit-plan --codecs`` reads: ``{"device", "ns_per_element", "measured", "torch"}``;
    returns what it wrote."""
    data = {
        "device": device,
        "ns_per_element": {str(k): float(v) for k, v in sorted(ns_per_element.items())},
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "torch": torch.__version__,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def table(header: list[str], rows: list[list]) -> str:
    """A markdown table; the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
