"""``optimizer.step()`` alone, before and after the multi-tensor/batched steps, on the e2e GPT.

The e2e benchmark at P = 4 (4 ranks sharing 2 CPU cores, 1 Gbit/s) is CPU-bound for 1-bit
LAMB and TurboQuant-Adam's planned-exact form: this times the one piece of their step that
is pure local arithmetic, the optimizer's update, in one process with one thread (what each
rank runs), on the GPT of ``benchmarks/e2e/worker.py`` (``examples/gpt_lion.GPT``: d=128,
4 layers, 4 heads, seq 64, 52 tensors, 0.83 M parameters). No process group: the staged
optimizers run their one-process path, which is their planned-exact path (the hook has
averaged the gradients as DDP does; the step forms the mean momentum from them).

Rows (``config``, ``stage``):

* ``DDP + AdamW``: ``torch.optim.AdamW`` as the e2e baseline builds it (CPU default:
  ``foreach=False``, the for-loop); ``foreach=True`` for comparison; ``DDP + Lion``: the
  Lion baseline (``lowbit_strategy.Lion``);
* ``before``: this package's code before the change, kept reachable here (the classes
  below): every staged optimizer's per-parameter loops and its ``isfinite(g).all()``
  NaN/Inf test per gradient; TurboQuant's exact form as it ran on P > 1 (the momentum
  formed, the gradient reconstructed from it for the variance, a zero-variance mask);
* ``after``: the package as it is.

Every optimizer starts from the same weights and gets the same gradients; steps run
round-robin over the configurations in a shuffled order (each starts cache-cold, as after
a backward), 3 untimed steps (the staged optimizers switch to their compression stage
after 2), then ``--steps`` timed ones: the median, with the 25th-75th percentiles. The
last column is the median over DDP + AdamW's. At the end, which runs ended bit-identical
(their parameters after all the steps, compared as bit patterns).

    python -m benchmarks.codecs.optim_step [--steps 60] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import logging
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import lowbit_strategy  # noqa: E402
from examples.gpt_lion import GPT  # noqa: E402

LR, WD = 3e-3, 0.1  # the e2e worker's AdamW learning rate, the GPT's weight decay
WARMUP = 2  # staged optimizers: warm-up steps before the timed compression-stage rows


# ---- the code before the change (for timing it; the tests hold the new code to it) ---------
def _old_nonfinite(grads) -> bool:
    return bool(grads) and bool(torch.stack([~torch.isfinite(g).all() for g in grads]).any())


class _Before:
    """The staged base's one-process/exact steps as they were: ``isfinite(g).all()`` per
    gradient, then one Python call of the per-parameter arithmetic per parameter; in the
    compression stage the mean momentum formed per parameter first."""

    def _warmup_step(self, step):
        active = [(grp, p) for grp in self.param_groups for p in grp["params"] if p.grad is not None]
        if _old_nonfinite([p.grad for _, p in active]):
            return self._skip()
        for grp, p in active:
            self._warmup(grp, p, p.grad, step)
        return bool(active)

    def _compressed_step(self, step):
        params, group_of = self._params(), self._group_of()
        if _old_nonfinite([p.grad for p in params if p.grad is not None]):
            return self._skip()
        means = {
            i: self._local_momentum(group_of[id(p)], p, p.grad) for i, p in enumerate(params) if p.grad is not None
        }
        for i, mean in means.items():
            self._compressed(group_of[id(params[i])], params[i], mean, step)
        return bool(means)


class OneBitLambBefore(_Before, lowbit_strategy.OneBitLamb):
    pass


class OneBitAdamBefore(_Before, lowbit_strategy.OneBitAdam):
    pass


class TurboQuantBefore(_Before, lowbit_strategy.TurboQuantAdamW):
    """Its planned-exact form on P > 1 as it was: the per-parameter compression-stage update
    (the variance from the gradient reconstructed from the momentum, the v = 0 mask)."""

    @property
    def _distributed(self) -> bool:
        return True


def _exact(opt):
    """A stand-in communicator of 4 ranks whose every bucket is planned ``fp32``: the
    optimizer takes its planned-exact path without a process group."""
    opt.communicator = SimpleNamespace(world_size=4, exact=True)
    return opt


def configs(params_of):
    """(config, stage, optimizer) rows; ``params_of()`` a fresh copy of the GPT's parameters."""
    never = 10**9
    L = lowbit_strategy
    return [
        ("DDP + AdamW", "-", torch.optim.AdamW(params_of(), lr=LR, weight_decay=WD)),
        ("DDP + AdamW foreach=True", "-", torch.optim.AdamW(params_of(), lr=LR, weight_decay=WD, foreach=True)),
        ("DDP + Lion", "-", L.Lion(params_of(), lr=1e-3, betas=(0.9, 0.99), weight_decay=WD)),
        ("1-bit LAMB before", "warm-up", OneBitLambBefore(params_of(), lr=LR, weight_decay=WD, freeze_step=never)),
        ("1-bit LAMB after", "warm-up", L.OneBitLamb(params_of(), lr=LR, weight_decay=WD, freeze_step=never)),
        ("1-bit LAMB before", "compression", OneBitLambBefore(params_of(), lr=LR, weight_decay=WD, freeze_step=WARMUP)),
        ("1-bit LAMB after", "compression", L.OneBitLamb(params_of(), lr=LR, weight_decay=WD, freeze_step=WARMUP)),
        ("1-bit Adam before", "warm-up", OneBitAdamBefore(params_of(), lr=LR, weight_decay=WD, freeze_step=never)),
        ("1-bit Adam after", "warm-up", L.OneBitAdam(params_of(), lr=LR, weight_decay=WD, freeze_step=never)),
        ("1-bit Adam before", "compression", OneBitAdamBefore(params_of(), lr=LR, weight_decay=WD, freeze_step=WARMUP)),
        ("1-bit Adam after", "compression", L.OneBitAdam(params_of(), lr=LR, weight_decay=WD, freeze_step=WARMUP)),
        ("TurboQuant before", "warm-up", TurboQuantBefore(params_of(), lr=LR, weight_decay=WD, warmup_steps=never)),
        ("TurboQuant after", "warm-up", L.TurboQuantAdamW(params_of(), lr=LR, weight_decay=WD, warmup_steps=never)),
        (
            "TurboQuant before",
            "exact fp32",
            _exact(TurboQuantBefore(params_of(), lr=LR, weight_decay=WD, warmup_steps=WARMUP)),
        ),
        (
            "TurboQuant after",
            "exact fp32",
            _exact(L.TurboQuantAdamW(params_of(), lr=LR, weight_decay=WD, warmup_steps=WARMUP)),
        ),
    ]


def _bits(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]).view(torch.int32)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="timed steps per configuration")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the e2e ranks use 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    logging.disable(logging.WARNING)  # the young-variance warning of freeze_step=2
    torch.manual_seed(0)
    model = GPT(seq=64, d=128, layers=4, heads=4)
    shapes = [p.shape for p in model.parameters()]

    def params_of():
        return [p.detach().clone().requires_grad_(True) for p in copy.deepcopy(model).parameters()]

    rows = configs(params_of)
    gen = torch.Generator().manual_seed(1)
    grad_sets = [[torch.randn(s, generator=gen) * 1e-2 for s in shapes] for _ in range(4)]
    times: list[list[float]] = [[] for _ in rows]
    order = random.Random(0)
    for step in range(3 + args.steps):
        ks = list(range(len(rows)))
        order.shuffle(ks)  # no configuration always runs after the same one
        for k in ks:
            opt = rows[k][2]
            params = [p for grp in opt.param_groups for p in grp["params"]]
            for p, g in zip(params, grad_sets[step % len(grad_sets)]):
                p.grad = g
            t = time.perf_counter()
            opt.step()
            if step >= 3:
                times[k].append(time.perf_counter() - t)
    base = statistics.median(times[0])
    print(
        f"optimizer.step() on the e2e GPT ({sum(s.numel() for s in shapes) / 1e6:.2f} M parameters, "
        f"{len(shapes)} tensors), {args.threads} thread(s), median of {args.steps} steps (25th-75th percentile)"
    )
    print(f"/proc/loadavg: {Path('/proc/loadavg').read_text().strip()}")
    print()
    print("| config | stage | ms per step | p25-p75 | x DDP + AdamW |")
    print("|---|---|---:|---:|---:|")
    for (name, stage, _), ts in zip(rows, times):
        q = statistics.quantiles(ts, n=4)
        med = statistics.median(ts)
        print(f"| {name} | {stage} | {1e3 * med:.2f} | {1e3 * q[0]:.2f}-{1e3 * q[2]:.2f} | {med / base:.2f} |")
    print()
    final = {(name, stage): _bits([p for grp in opt.param_groups for p in grp["params"]]) for name, stage, opt in rows}
    ref = final[("DDP + AdamW", "-")]
    print("Bit-identical parameters after all steps (every run got the same gradients):")
    for a, b in [
        (("1-bit LAMB before", "warm-up"), ("1-bit LAMB after", "warm-up")),
        (("1-bit LAMB before", "compression"), ("1-bit LAMB after", "compression")),
        (("1-bit Adam before", "warm-up"), ("1-bit Adam after", "warm-up")),
        (("1-bit Adam before", "compression"), ("1-bit Adam after", "compression")),
    ]:
        print(f"- {a[0]} = {b[0]} ({a[1]}): {torch.equal(final[a], final[b])}")
    for key in [
        ("DDP + AdamW foreach=True", "-"),
        ("1-bit Adam after", "warm-up"),
        ("TurboQuant before", "warm-up"),
        ("TurboQuant after", "warm-up"),
        ("TurboQuant before", "exact fp32"),
        ("TurboQuant after", "exact fp32"),
    ]:
        print(f"- {key[0]} ({key[1]}) = DDP + AdamW (for-loop): {torch.equal(final[key], ref)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
