"""Operators per bucket of every codec step as a GPU runs them, counted on a CPU: the CUDA code
paths (the Triton kernels) run under Triton's interpreter.

On a GPU these codecs are bound by the host issuing operators (the one-GPU check, part 4: on
an H100 BitDP's encode spent 10.1 of its 11.1 ms issuing 712 operators). That table needs a
GPU; this one does not. Every codec step of :mod:`benchmarks.gpu_check.codec_work` (the calls
the collectives make, split into encode / server / decode) runs once on one bucket of
``--numel`` float32 elements (server: P = ``-P`` rows), with every dispatch hook that sends
CUDA tensors to a Triton kernel sending CPU tensors to the same kernel run by the interpreter
(:func:`interpreted`). Per step it counts:

* **launches**: what a GPU launches, one per Triton kernel and one per torch operator that
  runs a kernel (every operator dispatched except views, metadata and bare allocations:
  :func:`launches_kernel`);
* **dispatched**: every torch operator dispatched, views and allocations included (what
  part 4's host table counts; Triton kernels are not torch operators). Operators the
  interpreter itself dispatches to move a kernel's arguments are not counted.

A step's count does not grow with the bucket's size on this path (the CPU's slice-by-slice
loops are not taken), so one bucket stands for every bucket; part 4's per-step figures are
these times the number of buckets (17 for GPT-2 small). The goal (the GPU codecs issue):
at most :data:`GOAL` launches per bucket per codec step; ``tests/benchmarks/test_host_ops.py``
holds each step to its budget (:data:`BUDGETS`).

    python -m benchmarks.codecs.host_ops [-P 8] [--numel 262144]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before any codec module imports triton (read at import)

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

#: the issue's target: torch operators or kernel launches per bucket per codec step
GOAL = 10
#: the most launches each codec step may take per bucket (the test holds them): the goal
#: where a step reaches it, else what the step takes today, so no change adds launches
BUDGETS = {
    ("lion_1bit", "encode"): GOAL,
    ("lion_1bit", "server"): GOAL,
    ("lion_1bit", "decode"): GOAL,
    ("lion_lp8", "encode"): 45,  # 3 per update vector (its own scale) + 18: 139 before the batched chain
    ("lion_lp8", "decode"): GOAL,
    ("compensated", "encode"): GOAL,
    ("compensated", "server"): GOAL,
    ("compensated", "decode"): GOAL,
    ("bitdp", "encode"): 23,
    ("bitdp", "server"): 30,
    ("bitdp", "decode"): GOAL,
    ("turboquant", "encode"): GOAL,
    ("turboquant", "server"): GOAL,
    ("turboquant", "decode"): GOAL,
}
#: Lion Cub's lp encode quantizes each update vector of a bucket with its own scale: the bucket's
#: vectors here (GPT-2 small's 17 buckets hold 148 tensors: ~9 each)
LION_PARTS = 8
#: the steps' codecs, as :mod:`benchmarks.gpu_check.codec_work` builds them
CODECS = ("lion_1bit", "lion_lp8", "compensated", "bitdp", "turboquant")
#: operators that launch no kernel: views and metadata, bare allocations, the interpreter's moves
_NO_KERNEL = {"empty", "empty_strided", "new_empty", "new_empty_strided", "set_", "lift_fresh", "detach", "alias",
              "_local_scalar_dense"}


def launches_kernel(func) -> bool:
    """Whether a dispatched operator runs a kernel on a GPU: not a view (``is_view``), not
    metadata or a bare allocation (:data:`_NO_KERNEL`)."""
    return not getattr(func, "is_view", False) and func.overloadpacket.__name__ not in _NO_KERNEL


class Counter(TorchDispatchMode):
    """Counts dispatched operators and Triton launches (:func:`interpreted` reports those),
    leaving out what a launch itself dispatches in the interpreter."""

    def __init__(self) -> None:
        super().__init__()
        self.dispatched = self.launches = self.triton = 0
        self.inside = 0
        self.names: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.inside:
            self.dispatched += 1
            if launches_kernel(func):
                self.launches += 1
                self.names[str(func)] = self.names.get(str(func), 0) + 1
        return func(*args, **(kwargs or {}))


_ACTIVE: list[Counter] = []


@contextlib.contextmanager
def interpreted():
    """Every dispatch hook that sends CUDA tensors to a Triton kernel sends CPU tensors to the
    interpreted kernel instead (the modules that import ``fused_kernels`` and TurboQuant's
    backend choice), and each launch is reported to the active :class:`Counter`."""
    from triton.runtime import interpreter

    from lowbit_strategy import codecs
    from lowbit_strategy.codecs import (
        channel,
        channel_triton,
        lp,
        scaled_signs,
        scaled_signs_decode,
        signs,
        signs_triton,
        turboquant,
        votes,
    )
    from lowbit_strategy.collectives import gathered

    assert signs_triton.INTERPRETED and channel_triton.INTERPRETED, "TRITON_INTERPRET=1 must be set before import"
    signs_hook = lambda t: signs_triton if signs_triton.serves(t) else None  # noqa: E731
    channel_hook = lambda t: channel_triton if channel_triton.serves(t) else None  # noqa: E731
    patches = [(m, "fused_kernels", signs_hook) for m in (signs, scaled_signs, scaled_signs_decode, votes, gathered)]
    majority = votes.majority_bits

    def majority_on_cuda(words, step, method="auto"):  # "auto" on CUDA: the fused kernel
        return majority(words, step, method="fused" if method == "auto" else method)

    many = lp.lp_quantize_many

    def many_on_cuda(xs, levels, p=1.0, *, batched=None):  # the bucket in one chain, as on a GPU
        return many(xs, levels, p, batched=True if batched is None else batched)

    patches += [(lp, "lp_quantize_many", many_on_cuda), (codecs, "lp_quantize_many", many_on_cuda)]
    patches += [(channel, "fused_kernels", channel_hook),
                (turboquant.TurboQuantCodec, "_use_triton", lambda self, device: self.block <= 1024),
                (votes, "majority_bits", majority_on_cuda), (codecs, "majority_bits", majority_on_cuda)]
    run = interpreter.GridExecutor.__call__

    def launch(self, *args, **kwargs):
        for counter in _ACTIVE:
            counter.triton += 1
            counter.launches += 1
            counter.inside += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            for counter in _ACTIVE:
                counter.inside -= 1

    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        interpreter.GridExecutor.__call__ = launch
        yield
    finally:
        interpreter.GridExecutor.__call__ = run
        for owner, name, value in saved:
            setattr(owner, name, value)


def count(fn) -> Counter:
    """One call of ``fn`` counted (inside :func:`interpreted`)."""
    with Counter() as counter:
        _ACTIVE.append(counter)
        try:
            fn()
        finally:
            _ACTIVE.remove(counter)
    return counter


def works(numel: int, p: int) -> dict:
    """Per codec: its :class:`~benchmarks.gpu_check.codec_work.Work` on one bucket of ``numel``
    elements (BitDP: the bucket as four matrices of GPT-2-like aspect)."""
    from benchmarks.gpu_check import codec_work as cw

    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    q = numel // 16
    shapes = [(q // 64, 64), (q // 256, 256), (4 * q // 512, 512), (numel - 6 * q - numel % 1024, 1)]
    builders = {
        "lion_1bit": lambda: cw.lion_1bit(x, p),
        "lion_lp8": lambda: cw.lion_lp(x, p, 8, LION_PARTS * [q] + [numel - LION_PARTS * q]),
        "compensated": lambda: cw.compensated(x, p),
        "bitdp": lambda: cw.bitdp([m for m in cw.matrices(x, shapes) if m.shape[1] > 1], p),
        "turboquant": lambda: cw.turboquant(x, p, "triton"),
    }
    return {name: builders[name]() for name in CODECS}


def measure(numel: int = 1 << 18, p: int = 8) -> dict[tuple[str, str], Counter]:
    """``{(codec, step): Counter}`` for every codec step of :data:`CODECS`."""
    got = {}
    with interpreted():
        for name, work in works(numel, p).items():
            for step in ("encode", "server", "decode"):
                fn = getattr(work, step)
                if fn is not None:
                    fn()  # a first call builds what later calls reuse (tables, sign bits)
                    got[(name, step)] = count(fn)
    return got


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.codecs.host_ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-P", type=int, default=8, help="rows the server step reduces (default 8)")
    parser.add_argument("--numel", type=int, default=1 << 18, help="elements of the bucket (default 2^18)")
    parser.add_argument("-v", action="store_true", help="name the operators that launch kernels")
    parser.add_argument("--json", action="store_true",
                        help="one line of JSON: goal, budgets, counts {codec: {step: [launches, dispatched, Triton]}}")
    args = parser.parse_args(argv)
    got = measure(args.numel, args.P)
    if args.json:
        out: dict = {"goal": GOAL, "counts": {}, "budgets": {}}
        for (name, step), c in got.items():
            out["counts"].setdefault(name, {})[step] = [c.launches, c.dispatched, c.triton]
        for (name, step), budget in BUDGETS.items():
            out["budgets"].setdefault(name, {})[step] = budget
        print(json.dumps(out))
        return 0
    print(f"Launches per bucket of {args.numel:,} elements, P = {args.P}, CUDA paths under Triton's interpreter "
          f"(cells: launches (Triton kernels) · dispatched torch operators; goal <= {GOAL} launches)\n")
    print("| codec | encode | server | decode |\n|---|---:|---:|---:|")
    for name in CODECS:
        cells = []
        for step in ("encode", "server", "decode"):
            c = got.get((name, step))
            mark = "" if c is None or c.launches <= GOAL else " ⚠"
            cells.append("-" if c is None else f"{c.launches} ({c.triton}) · {c.dispatched}{mark}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.v:
        for (name, step), c in got.items():
            named = sorted(c.names.items(), key=lambda kv: -kv[1])
            print(f"\n{name} {step}: " + ", ".join(f"{k} {v}" for k, v in named))
    return 0


if __name__ == "__main__":
    sys.exit(main())
