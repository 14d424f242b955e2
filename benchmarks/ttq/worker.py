"""One rank of :mod:`benchmarks.ttq.driver`: trains the GPT of ``examples/gpt_lion.py`` for a fixed
number of steps, timing every step and evaluating the held-out loss every ``--eval-every``
steps; rank 0 writes one JSON record.

The same worker serves the three kinds of run of the time-to-target study:

* **quality** runs (4 ranks as 2 nodes x 2 on loopback, ``--eval-every`` k): the validation
  loss curve against the step, which does not depend on the link;
* **timing** runs (the same ranks on a shaped link of :mod:`benchmarks.harness.netem`, no
  evaluation, a short compression warm-up ``--switch``): the seconds of every step, so
  that each phase (start-up, full-precision warm-up, compressed) is timed as it runs, and
  each phase's wire bytes per step from the node's qdisc counters;
* **full** runs (quality and timing at once, on a shaped link): what the projection of
  :mod:`benchmarks.ttq.analysis` is checked against.

Configurations are :data:`benchmarks.e2e.worker.CONFIGS` (the baselines of
:mod:`benchmarks.harness.baselines` and the lowbit strategies). ``--switch S``: the step after
which the compressed phase starts: PowerSGD's ``start_powerSGD_iter``, 1-bit Adam/LAMB's
``freeze_step``, TurboQuant's ``warmup_steps`` (0: the configuration has no warm-up).

**Clock** (rank 0; the ranks run in lock-step through their collectives): step i's time is
from the end of step i-1 (or the start of training) to the end of step i, so data loading,
forward, backward, synchronization, optimizer step and Lightning's own work are in it.
Evaluation and counter reads happen between steps and are not: the clock restarts after
them, behind a barrier. ``train_s`` of an evaluation = the training seconds before it.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import astuple
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402

from benchmarks.e2e.worker import CONFIGS, make_strategy, parse_overrides, rank_setup, resolved_plans, validate  # noqa: E402
from benchmarks.harness.leave import leave  # noqa: E402
from benchmarks.harness.netem import rank_counters  # noqa: E402
from examples.gpt_lion import GPT  # noqa: E402


def counters_or_none():
    """This rank's node link counters inside :mod:`benchmarks.harness.netem`, None on plain loopback."""
    return list(astuple(rank_counters())) if "LBS_NETNS" in os.environ else None


class Clock(pl.Callback):
    """Per-step seconds, training loss, evaluations and counter marks (see the module doc)."""

    def __init__(self, eval_every: int, eval_fn, marks: set[int]):
        self.eval_every, self.eval_fn, self.marks = eval_every, eval_fn, marks
        self.step_s: list[float] = []
        self.train_loss: list[float] = []
        self.evals: list[tuple[int, float, float]] = []
        self.counters: dict[int, list[int] | None] = {}
        self.plans: list[str] = []
        self._last = 0.0
        self._print = 0.0

    def _restart(self) -> None:
        dist.barrier()
        self._last = time.perf_counter()

    def on_train_start(self, trainer, pl_module) -> None:
        if self.eval_every:
            self.evals.append((0, 0.0, self.eval_fn(pl_module)))
        if 0 in self.marks:
            self.counters[0] = counters_or_none()
        self._restart()
        self._print = self._last

    def on_train_end(self, trainer, pl_module) -> None:
        # the strategy's teardown detaches the communicators after this hook: read the plans now
        self.plans = resolved_plans(trainer.strategy.optimizers)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.step_s.append(now - self._last)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.train_loss.append(round(float(loss), 4))
        step = trainer.global_step
        paused = False
        if self.eval_every and (step % self.eval_every == 0 or step == trainer.max_steps):
            self.evals.append((step, round(sum(self.step_s), 4), self.eval_fn(pl_module)))
            paused = True
        if step in self.marks:
            self.counters[step] = counters_or_none()
            paused = True
        if trainer.global_rank == 0 and now - self._print >= 15:
            self._print = now
            last = f", val {self.evals[-1][2]:.3f} @ {self.evals[-1][0]}" if self.evals else ""
            print(f"  step {step:5d}  {sum(self.step_s):7.1f}s  loss {float(loss):.3f}{last}", flush=True)
        if paused:
            self._restart()
        else:
            self._last = time.perf_counter()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, choices=sorted(CONFIGS))
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--out", required=True, help="JSON file rank 0 writes")
    ap.add_argument("--eval-every", type=int, default=0, help="validation loss every k steps (0: none)")
    ap.add_argument("--val-batches", type=int, default=16, help="held-out batches per rank")
    ap.add_argument("--switch", type=int, default=0, help="compression warm-up steps (see the module doc)")
    ap.add_argument("--marks", default="", help="comma-separated steps after which the link counters are read")
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--lr-warmup", type=int, default=50, help="linear LR warm-up steps")
    ap.add_argument("--schedule-steps", type=int, default=None, help="cosine decay length (default --steps)")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="per rank")
    ap.add_argument("--data-mb", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lowbit", default="", help="LowBitConfig overrides for lowbit_* strategies: KEY=VALUE,...")
    ap.add_argument("--timeout", type=float, default=600, help="process-group timeout (s)")
    ap.add_argument("--demo-topk", type=int, default=32, help="DeMo's compression_topk")
    args = ap.parse_args()
    kind, optimizer, p, per_node, tokens, split, train = rank_setup(args)
    onebit = optimizer in ("onebit_adam", "onebit_lamb", "turboquant")
    model = GPT(seq=args.seq, d=args.d_model, layers=args.layers, heads=args.heads, lr=args.lr, optimizer=optimizer,
                freeze_step=args.switch if onebit else None, warmup=args.lr_warmup,
                total_steps=args.schedule_steps or args.steps, demo_topk=args.demo_topk)
    strategy = make_strategy(kind, parse_overrides(args.lowbit),
                             powersgd_start=args.switch if kind == "powersgd" else None)

    def evaluate(module) -> float:
        # local updates (DiLoCo): the global weights, what the run delivers (a worker's own differ between syncs)
        scope = getattr(getattr(trainer.strategy, "sync", None), "global_weights", contextlib.nullcontext)
        with scope():
            loss = validate(module, tokens[split:], args.seq, args.batch, args.val_batches)
        module.train()
        return round(loss, 5)

    marks = {int(m) for m in args.marks.split(",") if m.strip()}
    clock = Clock(args.eval_every, evaluate, marks)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=per_node, num_nodes=p // per_node, max_steps=args.steps,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[clock], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    if trainer.strategy.cluster_environment.creates_processes_externally is not True:
        raise RuntimeError("Lightning would launch its own processes; LOCAL_RANK must be set by the harness")
    trainer.strategy._timeout = timedelta(seconds=args.timeout)
    trainer.fit(model, train)

    topology = getattr(getattr(trainer.strategy, "sync", None), "topology", None)
    every: list = [None] * p
    dist.all_gather_object(every, clock.counters)
    if dist.get_rank() == 0:
        rec = {
            "config": args.config, "strategy": kind, "optimizer": optimizer, "lr": args.lr, "seed": args.seed,
            "steps": trainer.global_step, "switch": args.switch, "P": p, "ranks_per_node": per_node,
            "link": os.environ.get("LBS_LINK", "loopback"),
            "link_bps": float(os.environ.get("LBS_LINK_BPS", 0)) or None,
            "params": sum(t.numel() for t in model.parameters()),
            "topology": topology.describe() if topology is not None else "flat (DDP)",
            "plan": clock.plans, "hook_calls": getattr(trainer.strategy, "hook_calls", None),
            "lowbit_overrides": args.lowbit or None,
            "step_s": [round(t, 5) for t in clock.step_s], "train_loss": clock.train_loss, "evals": clock.evals,
            # counters per node (first rank of each node): [if_tx, if_rx, wire_tx, wire_rx] after each mark step
            "counters": {str(k): [every[r][k] for r in range(0, p, per_node)] for k in sorted(marks)
                         if clock.counters.get(k) is not None},
        }
        Path(args.out).write_text(json.dumps(rec) + "\n")
        last = f", val {clock.evals[-1][2]:.4f}" if clock.evals else ""
        print(f"  done: {rec['steps']} steps in {sum(clock.step_s):.1f} s of training{last}", flush=True)
    return 0  # the group is destroyed by leave(), once this frame is gone


if __name__ == "__main__":
    leave(main())
