"""One rank of :mod:`benchmarks.e2e.driver`: trains the GPT of ``examples/gpt_lion.py`` for a
wall-clock budget inside the emulated network, then rank 0 writes one JSON record.

**Launch.** The harness starts every rank itself, with ``MASTER_ADDR``/``MASTER_PORT``,
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``GLOO_SOCKET_IFNAME`` set. The Trainer is built
with ``devices=P, num_nodes=1``: Lightning picks its ``LightningEnvironment``, whose
``creates_processes_externally`` is true as soon as ``LOCAL_RANK`` is set, so its "popen"
launcher spawns nothing, the global rank is ``LOCAL_RANK`` (node 0), and the process group
is initialized with env:// over gloo on the interface the harness named. With nodes
(``Network(nodes=N, ranks_per_node=L)``, which sets torchrun's ``LOCAL_WORLD_SIZE`` = L and
``NODE_RANK``), it is ``devices=L, num_nodes=N``: global rank = ``NODE_RANK`` * L +
``LOCAL_RANK``, as torchrun numbers them.

**Configurations** (:data:`CONFIGS`): the baselines of :mod:`benchmarks.harness.baselines` (DDP's
fp32 allreduce, torch's ``bf16_compress_hook``, ``fp16_compress_hook`` and ``powerSGD_hook``,
each with Lion and with AdamW), the registered ``lowbit_*`` strategies, and two calibration
runs (``calib_*``) whose comm hook keeps every gradient local, so that nothing but the
budget flag crosses the wire: their step time is the compute time. PowerSGD's fp32 warm-up
is :data:`POWERSGD_START` steps here (the steady-state window times its compressed stage).

**What is measured** (rank 0's clock; the ranks run in lock-step, see :class:`Probe`):

* a 4-byte broadcast from rank 0 after every step says whether the budget is spent
  (Lightning's own ``max_time`` does the same with two pickled broadcasts);
* the steady-state window starts after step ``--warm`` (DDP's bucket rebuild and
  PowerSGD's fp32 warm-up are over by then) and ends at the last step: step time =
  window seconds / window steps; each rank's qdisc counters are read at both ends
  (outside the timed window, followed by a barrier), giving wire bytes per step;
* communication seconds and payload bytes of the lowbit strategies: what their traffic
  logs recorded (read through ``CommStats``), over the same window;
* loss reached: mean over ranks of the mean training loss of the last 20 steps;
  validation loss: ``--val-batches`` held-out batches per rank, averaged over ranks;
* the loss curve: rank 0's own training loss every ``--log-every`` steps with the wall
  seconds since training started (process start-up and DDP setup are not in it).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import time
import warnings
from collections import Counter
from dataclasses import astuple
from datetime import timedelta
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.strategies import StrategyRegistry  # noqa: E402
from torch.utils.data import DataLoader, Subset  # noqa: E402

import lowbit_strategy  # noqa: E402,F401  (registers the lowbit_* strategies)
from benchmarks.harness.baselines import HOOKS, HookedDDP, make_baseline, powersgd_settings  # noqa: E402,F401
from benchmarks.harness.leave import leave  # noqa: E402
from benchmarks.harness.netem import rank_counters  # noqa: E402
from callbacks import CommStats  # noqa: E402
from examples.gpt_lion import GPT, Windows, stdlib_bytes  # noqa: E402

#: name -> (strategy kind, optimizer). Kinds: "ddp", "fp16", "powersgd", "local" (calibration,
#: nothing synchronized) or a registered strategy name.
CONFIGS: dict[str, tuple[str, str]] = {
    "ddp_lion": ("ddp", "lion"),
    "ddp_adamw": ("ddp", "adamw"),
    "ddp_bf16_lion": ("bf16", "lion"),
    "ddp_bf16_adamw": ("bf16", "adamw"),
    "ddp_fp16_lion": ("fp16", "lion"),
    "ddp_fp16_adamw": ("fp16", "adamw"),
    "ddp_powersgd_lion": ("powersgd", "lion"),
    "ddp_powersgd_adamw": ("powersgd", "adamw"),
    "lowbit_lion": ("lowbit_lion", "lion"),
    "lowbit_lion_1bit": ("lowbit_lion_1bit", "lion"),
    "lowbit_lion_1bit_sync10": ("lowbit_lion_1bit", "lion"),
    "lowbit_lion_4bit": ("lowbit_lion_4bit", "lion"),
    "lowbit_lion_8bit": ("lowbit_lion_8bit", "lion"),
    "lowbit_lion_fp32": ("lowbit_lion_fp32", "lion"),
    "lowbit_bitdp_adamw": ("lowbit_bitdp", "adamw"),
    "lowbit_bitdp_1bit_adamw": ("lowbit_bitdp_1bit", "adamw"),
    "lowbit_adam": ("lowbit_adam", "onebit_adam"),
    "lowbit_lamb": ("lowbit_lamb", "onebit_lamb"),
    "lowbit_turboquant": ("lowbit_turboquant", "turboquant"),
    # DiLoCo's forms (their LowBitConfig overrides: benchmarks.ttq.driver.DILOCO): the user's AdamW inside
    "lowbit_diloco_fp32_h50": ("lowbit_diloco", "adamw"),
    "lowbit_diloco_int4_h50": ("lowbit_diloco", "adamw"),
    "lowbit_diloco_sign_h50": ("lowbit_diloco", "adamw"),
    "lowbit_diloco_int4_h150": ("lowbit_diloco", "adamw"),
    "lowbit_diloco_int4_h10": ("lowbit_diloco", "adamw"),
    "lowbit_diloco_stream_int4_h50": ("lowbit_diloco", "adamw"),
    "lowbit_diloco_sign_h10": ("lowbit_diloco", "adamw"),
    "lowbit_diloco_stream_int4_h10": ("lowbit_diloco", "adamw"),
    "lowbit_diloco_stream_int4_h10_d4": ("lowbit_diloco", "adamw"),
    # DeMo's forms (their LowBitConfig overrides and top-k: benchmarks.ttq.driver.DEMO)
    "lowbit_demo_fp32_k32": ("lowbit_demo", "demo"),
    "lowbit_demo_sign_k32": ("lowbit_demo", "demo"),
    "lowbit_demo_sign_k8": ("lowbit_demo", "demo"),
    "lowbit_demo_sign_k8_d1": ("lowbit_demo", "demo"),
    "calib_lion": ("local", "lion"),
    "calib_adamw": ("local", "adamw"),
}
#: PowerSGD's fp32 warm-up in these timing runs: short, so that the steady-state window (after
#: ``--warm`` steps) times the compressed stage; rank and the rest: :data:`benchmarks.harness.baselines.POWERSGD`
POWERSGD_START = 10
POWERSGD = powersgd_settings(POWERSGD_START)


def available(name: str) -> bool:
    """Whether configuration ``name`` can run with the strategies registered now."""
    kind = CONFIGS[name][0]
    return kind in HOOKS or kind in StrategyRegistry


def parse_overrides(text: str) -> dict:
    """``"bucket_size_mb=1,lion_overlap=false"`` -> LowBitConfig keyword overrides (YAML values)."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--lowbit: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def make_strategy(kind: str, overrides: dict | None = None, powersgd_start: int = POWERSGD_START):
    """A baseline of :mod:`benchmarks.harness.baselines` or a registered lowbit strategy (with overrides)."""
    if kind in HOOKS:
        return make_baseline(kind, powersgd_start)
    if overrides:  # a registered name, with LowBitConfig overrides on top of its own
        entry = StrategyRegistry[kind]
        return entry["strategy"](**{**entry["init_params"], **overrides})
    return kind  # a registered name


def resolved_plans(optimizers) -> list[str]:
    """What each lowbit communicator's ``auto`` resolved to, one string per optimizer that has
    one: Lion Cub's :class:`~lowbit_strategy.algorithms.lion_cub.mode.SyncMode` (its ``plan``),
    recorded as ``Plan(mode='lp', bits=8, levels=31)`` (the results' format since the first run), or
    TurboQuant's per-bucket forms (its ``forms``) as ``forms: fp32 x2, tq x7`` (forms sorted by
    name). Read before the strategy's teardown detaches the communicators; an algorithm without
    a plan (or a baseline) gives nothing."""
    found = []
    for opt in optimizers:
        comm = getattr(getattr(opt, "_optimizer", opt), "communicator", None)
        plan, forms = getattr(comm, "plan", None), getattr(comm, "forms", None)
        if plan is not None:
            found.append(f"Plan(mode={plan.mode!r}, bits={plan.bits}, levels={plan.levels})")
        elif forms:
            found.append("forms: " + ", ".join(f"{f} x{n}" for f, n in sorted(Counter(forms.values()).items())))
    return found


class Probe(pl.Callback):
    """Budget flag, steady-state window (time, counters, comm seconds), losses, curve."""

    def __init__(self, budget_s: float, warm: int, log_every: int, stats: CommStats):
        self.budget_s, self.warm, self.log_every, self.stats = budget_s, warm, log_every, stats
        self.losses: list[float] = []
        self.curve: list[tuple[float, int, float]] = []
        self.in_step: list[float] = []
        self.marks: dict[str, tuple] = {}  # name -> (step, seconds, counters, comm_s, hook_calls, sent)
        self._t0 = self._tb = 0.0
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._last_print = 0.0
        self.plans: list[str] = []

    def on_train_start(self, trainer, pl_module) -> None:
        dist.barrier()
        self._t0 = self._last_print = time.perf_counter()

    def on_train_batch_start(self, *args) -> None:
        self._tb = time.perf_counter()

    def _mark(self, name: str, trainer, step: int, before: bool) -> None:
        """Counters + clock at a window edge; the clock is read on the window's side."""
        now = time.perf_counter() if before else None
        counters = rank_counters()
        if not before:
            dist.barrier()
            now = time.perf_counter()
        hooks = getattr(trainer.strategy, "hook_calls", 0)
        usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this rank (gloo's included)
        self.marks[name] = (step, now - self._t0, counters, self.stats.total_seconds, hooks,
                            self.stats.total_bytes_sent, usage.ru_utime + usage.ru_stime)
        if name == "end":  # the communicators are detached at teardown: read their plans now
            self.plans = resolved_plans(trainer.strategy.optimizers)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.in_step.append(now - self._tb)
        step = trainer.global_step
        loss = float(outputs["loss"]) if isinstance(outputs, dict) else float(outputs)
        self.losses.append(loss)
        wall = now - self._t0
        if step % self.log_every == 0 or step == 1:
            self.curve.append((round(wall, 3), step, round(loss, 4)))
        if trainer.global_rank == 0:
            self._flag.fill_(int(wall >= self.budget_s))
            if now - self._last_print >= 15:
                self._last_print = now
                print(f"  step {step:5d}  {wall:6.1f}s  loss {loss:.3f}", flush=True)
        dist.broadcast(self._flag, src=0)
        if step in (2, self.warm):
            self._mark(f"s{step}", trainer, step, before=False)
        if self._flag.item():
            self._mark("end", trainer, step, before=True)
            if (step, round(wall, 3), round(loss, 4)) not in self.curve:
                self.curve.append((round(wall, 3), step, round(loss, 4)))
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        if "end" not in self.marks:  # stopped by max_steps or the data running out
            self._mark("end", trainer, trainer.global_step, before=True)


def validate(model: GPT, tokens: torch.Tensor, seq: int, batch: int, batches: int) -> float:
    """Mean loss over ``batches`` held-out batches per rank (rank-interleaved), all ranks."""
    p, rank = dist.get_world_size(), dist.get_rank()
    data = Windows(tokens, seq)
    idx = [i for i in range(min(len(data), batches * batch * p)) if (i // batch) % p == rank]
    total = torch.zeros(2, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for x, y in DataLoader(Subset(data, idx), batch_size=batch):
            total += torch.tensor([model._loss((x, y)).item() * len(x), len(x)], dtype=torch.float64)
    dist.all_reduce(total)
    return float(total[0] / total[1])


class RankSetup(NamedTuple):
    kind: str
    optimizer: str
    world: int
    per_node: int
    tokens: torch.Tensor
    split: int
    train: DataLoader


def rank_setup(args) -> RankSetup:
    """What a benchmark rank does first (this worker's and :mod:`benchmarks.ttq.worker`'s):
    one torch thread (P ranks share this machine's cores), quiet Lightning, its
    configuration's strategy kind and optimizer, the world size and node size, the seed, and
    the GPT example's data: ``tokens``, the first ``split`` of them (90 %) for training in
    ``train``, the rest held out. The node size is the harness's (``benchmarks.harness.netem --nodes
    N --ranks-per-node L``: torchrun's ``LOCAL_WORLD_SIZE``); without it (per-rank form), one
    node of P devices."""
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    kind, optimizer = CONFIGS[args.config]
    world = int(os.environ["WORLD_SIZE"])
    pl.seed_everything(args.seed, verbose=False)
    tokens = stdlib_bytes(int(args.data_mb * 2**20))
    split = int(len(tokens) * 0.9)
    train = DataLoader(Windows(tokens[:split], args.seq), batch_size=args.batch, shuffle=True, drop_last=True)
    return RankSetup(kind, optimizer, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), tokens, split, train)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, choices=sorted(CONFIGS))
    ap.add_argument("--budget", type=float, required=True, help="training seconds")
    ap.add_argument("--out", required=True, help="JSON file rank 0 writes")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="per rank")
    ap.add_argument("--lr-lion", type=float, default=1e-3)
    ap.add_argument("--lr-adamw", type=float, default=3e-3)
    ap.add_argument("--warmup-steps", type=int, default=20, help="LR warm-up")
    ap.add_argument("--schedule-steps", type=int, default=2000, help="cosine decay length (steps)")
    ap.add_argument("--warm", type=int, default=20, help="steps excluded from the steady-state window")
    ap.add_argument("--log-every", type=int, default=2)
    ap.add_argument("--freeze-step", type=int, default=100,
                    help="1-bit Adam/LAMB warm-up steps (keep --warm past it to time the compression stage)")
    ap.add_argument("--lowbit", default="", help="LowBitConfig overrides for lowbit_* strategies: KEY=VALUE,...")
    ap.add_argument("--val-batches", type=int, default=8, help="per rank")
    ap.add_argument("--data-mb", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300, help="process-group timeout (s)")
    args = ap.parse_args()
    kind, optimizer, p, per_node, tokens, split, train = rank_setup(args)
    lr = args.lr_lion if optimizer == "lion" else args.lr_adamw
    model = GPT(seq=args.seq, d=args.d_model, layers=args.layers, heads=args.heads, lr=lr, optimizer=optimizer,
                freeze_step=args.freeze_step,
                warmup=args.warmup_steps, total_steps=args.schedule_steps)
    stats = CommStats(prog_bar=False)
    probe = Probe(args.budget, args.warm, args.log_every, stats)
    overrides = parse_overrides(args.lowbit)
    link_bps = float(os.environ.get("LBS_LINK_BPS", "0"))
    if isinstance(kind, str) and kind.startswith("lowbit") and link_bps:
        # the planners (Lion Cub's and TurboQuant's auto) are told the link, as a user configures it
        overrides.setdefault("link_bandwidth_gbps", link_bps / 1e9)
    trainer = pl.Trainer(
        strategy=make_strategy(kind, overrides), accelerator="cpu", devices=per_node,
        num_nodes=p // per_node, max_epochs=-1,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[stats, probe], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    if trainer.strategy.cluster_environment.creates_processes_externally is not True:
        raise RuntimeError("Lightning would launch its own processes; LOCAL_RANK must be set by the harness")
    trainer.strategy._timeout = timedelta(seconds=args.timeout)
    trainer.fit(model, train)

    rank = dist.get_rank()
    tail = probe.losses[-20:]
    loss_reached = torch.tensor([sum(tail) / max(1, len(tail))], dtype=torch.float64)
    dist.all_reduce(loss_reached)
    val_loss = validate(model, tokens[split:], args.seq, args.batch, args.val_batches)

    marks = probe.marks
    start = marks.get(f"s{args.warm}")
    if start is None or marks["end"][0] - start[0] < 5:
        start = marks.get("s2", start)
    end = marks["end"]
    n = max(1, end[0] - start[0])
    delta = end[2] - start[2]
    mine = [n, end[1] - start[1], *(v / n for v in astuple(delta)), (end[3] - start[3]) / n,
            (end[4] - start[4]) / n, statistics.median(probe.in_step[start[0]:end[0]] or probe.in_step),
            (end[5] - start[5]) / n, (end[6] - start[6]) / n]
    every = [torch.empty(len(mine), dtype=torch.float64) for _ in range(p)]
    dist.all_gather(every, torch.tensor(mine, dtype=torch.float64))
    if rank == 0:
        keys = ("window_steps", "window_s", "if_tx", "if_rx", "wire_tx", "wire_rx", "comm_s", "hook_calls",
                "in_step_s", "recorded_sent", "cpu_s")
        per_rank = [dict(zip(keys, t.tolist())) for t in every]
        rec = {
            "config": args.config, "strategy": kind if isinstance(kind, str) else "", "optimizer": optimizer,
            "lr": lr, "P": p, "ranks_per_node": per_node, "link": os.environ.get("LBS_LINK", "?"),
            "link_bps": float(os.environ.get("LBS_LINK_BPS", "0")) or None,
            "params": sum(t.numel() for t in model.parameters()), "budget_s": args.budget,
            "steps": trainer.global_step, "train_s": end[1], "window_first_step": start[0],
            "step_s": per_rank[0]["window_s"] / per_rank[0]["window_steps"],
            "in_step_s": per_rank[0]["in_step_s"],
            "comm_s_recorded": statistics.mean(r["comm_s"] for r in per_rank),
            "recorded_bytes_per_step": max(r["recorded_sent"] for r in per_rank),
            # CPU seconds per step summed over ranks, spread over the machine's cores: the
            # step time if the run were CPU-bound (it cannot run faster than this)
            "cpu_s_per_step": sum(r["cpu_s"] for r in per_rank),
            "cpu_floor_s": sum(r["cpu_s"] for r in per_rank) / (os.cpu_count() or 1),
            "wire_bytes_per_step": max(max(r["wire_tx"], r["wire_rx"]) for r in per_rank),
            "hook_calls_per_step": per_rank[0]["hook_calls"],
            "loss_reached": float(loss_reached) / p, "val_loss": val_loss,
            "plan": probe.plans, "per_rank": per_rank, "curve": probe.curve,
        }
        Path(args.out).write_text(json.dumps(rec) + "\n")
        print(f"  done: {rec['steps']} steps, {rec['step_s'] * 1e3:.1f} ms/step, "
              f"wire {rec['wire_bytes_per_step'] / 1e3:.1f} kB/step, loss {rec['loss_reached']:.3f}, "
              f"val {val_loss:.3f}", flush=True)
    return 0  # the group is destroyed by leave(), once this frame is gone


if __name__ == "__main__":
    leave(main())
