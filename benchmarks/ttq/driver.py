"""Time to quality: how long each method takes to reach a given validation loss on 2 emulated
nodes x 2 ranks joined by a 1 Gbit/s, 100 Mbit/s or 10 Mbit/s link (the benchmark of record).

DiLoCo's forms (:data:`DILOCO`) are evaluated on their global weights (what the run delivers;
between syncs each worker's own differ), and their timing runs span two rounds (:func:`diloco_h`).

Methods: every algorithm's default form (hierarchical on this 2 x 2 layout: ``topology``
``auto``) and its 1-bit form where it has one, against the DDP baselines of
:mod:`benchmarks.harness.baselines` (fp32, torch's ``bf16_compress_hook``, torch's ``powerSGD_hook``
rank 4 with its default warm-up), each with AdamW and with Lion.

How (the issue allows it; :mod:`benchmarks.ttq.analysis` holds the arithmetic):

1. **timing** runs, per (configuration, link): the worker on :mod:`benchmarks.harness.netem`'s
   2 x 2 nodes, a few steps of each phase (start-up, full-precision warm-up, compressed),
   every step timed, each phase's wire bytes counted;
2. **lr sweep**: per configuration, seed 0 at a centre x ``--lr-factors`` (3 values), the
   same steps; the lowest final validation loss wins (recorded). The references DDP + AdamW
   and DDP + Lion are swept first, around the example's default; every other configuration
   around its optimizer's default times the factor its reference moved by
   (:func:`centre_lr`). While the winner is the lowest or highest lr tried, half or twice it
   is tried too, up to ``--sweep-extend`` times (:func:`beyond_edge`): an optimum at the
   sweep's edge is not one;
3. **quality** runs on loopback (the same 2 x 2 ranks, node variables set, no shaping):
   seeds ``--seeds`` at the chosen lr, validation loss every ``--eval-every`` steps;
4. the projection: loss after step s is reached on a link at the training seconds of steps
   1..s, each timed in its phase on that link;
5. **validation**: ``--validate CONFIG@LINK`` runs the whole training on the link, measured;
   the report states how far the projection is from it.

**The comm-free bound** (:data:`BOUND`, ``--no-bound`` to leave it out): what no method can beat, the
same training with nothing on the wire (DDP whose hook keeps each rank's gradient; not a method).
Its timing runs run on every link beside the methods'; the report prices DDP fp32's steps to
each target at its step time, and gives every method's time as a fraction of it.

Lion Cub's and TurboQuant's ``auto`` plans depend on the link: their runs are told the link
(``link_bandwidth_gbps``, ``link_latency_us`` fixed at :data:`LATENCY_US`) and their quality
runs are per link, unless both links' timing runs resolved the same plan.

Every run is one JSON under ``<out>/runs/`` carrying the settings it ran with; with
``--skip-existing`` a run whose JSON exists with the same settings is not run again, so the
study can be continued across sessions (``--max-minutes`` stops it cleanly). Every run also
records :func:`code_fingerprint`; ``--retime`` reruns the timing runs that older code made (the
report lists them), so the final tables time the code users get.

Usage (root needed for the links)::

    python -m benchmarks.ttq --quick               # <= 10 min: small model, 4 configs -> results/ttq/quick/
    python -m benchmarks.ttq --skip-existing       # the full study (hours; see --dry-run) -> results/ttq/
    python -m benchmarks.ttq --skip-existing --retime   # ... and time again what older code timed
    python -m benchmarks.ttq --dry-run             # the runs it would do
    python -m benchmarks.ttq --report-only
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

from benchmarks.harness import procs
from benchmarks.ttq import report as ttq_report
from benchmarks.harness.baselines import POWERSGD
from benchmarks.harness.host import ROOT, cpu_busy_s, machine, own_cpu_s, parse_link
from benchmarks.e2e.worker import CONFIGS, available
from benchmarks.harness.netem import NetemError, Network, require_root
from benchmarks.ttq.analysis import STARTUP, best_lr, phase_times

RESULTS = ROOT / "benchmarks" / "results" / "ttq"
BASELINES = ["ddp_adamw", "ddp_lion", "ddp_bf16_adamw", "ddp_bf16_lion", "ddp_powersgd_adamw", "ddp_powersgd_lion"]
#: DiLoCo's forms: configuration -> its LowBitConfig overrides (the fp32 outer sync of torchft- and
#: PRIME-style DiLoCo, int4 and 1-bit pseudo-gradients, two H, the streaming form)
DILOCO = {
    "lowbit_diloco_fp32_h50": "diloco_compression=fp32,diloco_sync_every=50",
    "lowbit_diloco_int4_h50": "diloco_compression=int4,diloco_sync_every=50",
    "lowbit_diloco_sign_h50": "diloco_compression=sign,diloco_sync_every=50",
    "lowbit_diloco_int4_h150": "diloco_compression=int4,diloco_sync_every=150",
    "lowbit_diloco_int4_h10": "diloco_compression=int4,diloco_sync_every=10",
    "lowbit_diloco_stream_int4_h50": "diloco_compression=int4,diloco_sync_every=50,diloco_fragments=2,diloco_delay=1",
    # the outer settings the sweep chose at this scale (benchmarks.ttq.diloco_sweep): lr 0.7, momentum 0.5
    "lowbit_diloco_sign_h10": "diloco_compression=sign,diloco_sync_every=10,diloco_outer_lr=0.7,diloco_outer_momentum=0.5",
    "lowbit_diloco_stream_int4_h10": "diloco_compression=int4,diloco_sync_every=10,diloco_fragments=2,diloco_delay=1,"
                                     "diloco_outer_lr=0.7,diloco_outer_momentum=0.5",
    # the longest delay H = 10 and F = 2 allow (τ·F < H): 4 inner steps to hide each exchange behind
    "lowbit_diloco_stream_int4_h10_d4": "diloco_compression=int4,diloco_sync_every=10,diloco_fragments=2,"
                                        "diloco_delay=4,diloco_outer_lr=0.7,diloco_outer_momentum=0.5",
}
#: DeMo's forms: configuration -> (its LowBitConfig overrides, compression_topk): the paper's fp32
#: values, 1-bit values at top-32 and top-8 of 64 x 64 chunks, and top-8 applied a step late
DEMO = {
    "lowbit_demo_fp32_k32": ("demo_values=fp32", 32),
    "lowbit_demo_sign_k32": ("demo_values=sign", 32),
    "lowbit_demo_sign_k8": ("demo_values=sign", 8),
    "lowbit_demo_sign_k8_d1": ("demo_values=sign,demo_delay=1", 8),
}
#: other forms of an algorithm: configuration -> its LowBitConfig overrides. Lion Cub 1-bit with the
#: momentum sync its paper pairs with the 1-bit vote (the input and output layers' momenta averaged
#: every 10 steps, Sec. 5, Fig. 8's "sync head")
FORMS = {"lowbit_lion_1bit_sync10": "lion_momentum_sync_every=10"}
#: every algorithm's default and its 1-bit form (TurboQuant has none: 2..8 bits)
ALGORITHMS = ["lowbit_lion", "lowbit_lion_1bit", "lowbit_bitdp_adamw", "lowbit_bitdp_1bit_adamw", "lowbit_adam",
              "lowbit_lamb", "lowbit_turboquant", *DILOCO, *DEMO, *FORMS]
#: the comm-free bound of each target's optimizer family (:mod:`benchmarks.e2e.worker`'s calibration
#: configurations: DDP whose hook keeps every rank's gradient, the same computation with nothing on the
#: wire; not a method): timed on every link, priced at the family's DDP fp32 steps to the target
BOUND = {"ddp_adamw": "calib_adamw", "ddp_lion": "calib_lion"}
#: configurations with an uncompressed phase whose wire ``LowBitConfig.warmup_wire`` names (a warm-up,
#: BitDP's two first iterations, an ``auto`` fallback): their runs carry it in their overrides
WIRED = {"lowbit_lion", "lowbit_bitdp_adamw", "lowbit_bitdp_1bit_adamw", "lowbit_adam", "lowbit_lamb",
         "lowbit_turboquant"}
#: the :data:`WIRED` configurations whose warm-up ``warmup_wire="int2"`` codes (the staged optimizers')
CODED = {"lowbit_adam", "lowbit_lamb", "lowbit_turboquant"}
#: configurations whose plan reads the link (Lion Cub's mode and TurboQuant's form ``auto``)
LINK_PLANNED = {"lowbit_lion", "lowbit_turboquant"}
LATENCY_US = 50
#: the example's learning rates (examples/gpt_lion.py): the centre of the references' sweeps
DEFAULT_LR = {"lion": 1e-3, "adamw": 3e-3, "onebit_adam": 3e-3, "onebit_lamb": 3e-3, "turboquant": 3e-3,
              "demo": 1e-3}
#: each optimizer's uncompressed reference (swept first): the other configurations' sweeps are
#: centred where its sweep ended (:func:`centre_lr`)
REFERENCE = {"lion": "ddp_lion", "adamw": "ddp_adamw", "onebit_adam": "ddp_adamw", "onebit_lamb": "ddp_adamw",
             "turboquant": "ddp_adamw", "demo": "ddp_lion"}
#: what a run executes, so what its step times depend on (:func:`code_fingerprint`)
CODE = ["lowbit_strategy", "callbacks", "examples/gpt_lion.py", "benchmarks/harness/baselines.py", "benchmarks/e2e/worker.py",
        "benchmarks/ttq/worker.py", "benchmarks/harness/netem.py", "benchmarks/harness/leave.py"]
#: parts of :data:`CODE` that no run executes (the pre-flight planner, never imported in training:
#: a test holds it so), left out of :func:`code_fingerprint` so that changing them does not mark
#: the timing runs as made by other code
NOT_RUN = ["lowbit_strategy/plan"]
MODEL = {"d_model": 256, "layers": 5, "heads": 4, "seq": 64, "batch": 8, "data_mb": 6.0}
FULL = {"configs": BASELINES + ALGORITHMS, "steps": 1500, "eval_every": 25, "val_batches": 16, "lr_warmup": 50,
        "seeds": "0,1,2", "lr_factors": "0.5,1,2", "sweep": "all", "sweep_extend": 4, "timing_warm": 15,
        "timing_main": 30,
        "validate": "ddp_bf16_adamw@1gbit,lowbit_adam@100mbit", "model": MODEL, "powersgd_start": None}
#: a smoke run of every stage: 0.44M parameters, 120 steps, one seed, one configuration swept
QUICK = {"configs": ["ddp_adamw", "ddp_bf16_adamw", "ddp_powersgd_adamw", "lowbit_adam"], "steps": 120,
         "eval_every": 20, "val_batches": 8, "lr_warmup": 10, "seeds": "0", "lr_factors": "0.5,1,2",
         "sweep": "lowbit_adam", "sweep_extend": 0, "timing_warm": 8, "timing_main": 15,
         "validate": "ddp_bf16_adamw@1gbit,lowbit_adam@100mbit",
         "model": {**MODEL, "d_model": 128, "layers": 2, "data_mb": 2.0}, "powersgd_start": "20%"}


def switch_of(config: str, steps: int, powersgd_start: str | None) -> int:
    """The compression warm-up of ``config`` in a run of ``steps``: PowerSGD's
    ``start_powerSGD_iter`` (torch's default unless ``powersgd_start``, "N" or "P%"), 1-bit
    Adam/LAMB's freeze step and TurboQuant's warm-up at the example's 20 % of the run, else 0."""
    kind, optimizer = CONFIGS[config]
    if kind == "powersgd":
        if powersgd_start is None:
            return int(POWERSGD["start_powerSGD_iter"])
        return int(steps * float(powersgd_start[:-1]) / 100) if powersgd_start.endswith("%") else int(powersgd_start)
    return max(1, steps // 5) if optimizer in ("onebit_adam", "onebit_lamb", "turboquant") else 0


class Study:
    """Settings, run files, and the runs themselves (see the module doc)."""

    def __init__(self, args, out: Path):
        self.args, self.out = args, out
        self.links = [parse_link(t.strip()) for t in args.links.split(",")]
        self.model = dict(args.model)
        self.start, self.done_runs, self.planned = time.monotonic(), 0, 0
        self.deadline = self.start + args.max_minutes * 60
        self.code = code_fingerprint()
        #: only read the runs that exist (--report-only)
        self.load_only = False

    def base(self, config: str = "") -> dict:
        """The settings every run of ``config`` shares (a DeMo form adds its top-k: the others'
        settings, and so their recorded runs, stay as they were)."""
        extra = {"demo_topk": DEMO[config][1]} if config in DEMO else {}
        return {**self.model, "val_batches": self.args.val_batches, "lr_warmup": self.args.lr_warmup,
                "schedule_steps": self.args.steps, **extra}

    def overrides(self, config: str, link, plan: list[str] | None = None) -> str:
        """A :data:`LINK_PLANNED` configuration's LowBitConfig overrides: the link, and the
        ``plan`` :func:`pin` fixes (else ``auto`` resolves it); a :data:`DILOCO` form's own; for
        the :data:`WIRED` ones first ``warmup_wire`` (``--warmup-wire``)."""
        if config in DILOCO:
            return DILOCO[config]
        if config in DEMO:
            return DEMO[config][0]
        if config in FORMS:
            return FORMS[config]
        wire = f"warmup_wire={wire_of(getattr(self.args, 'warmup_wire', 'bf16'), config)}" if config in WIRED else ""
        if config not in LINK_PLANNED:
            return wire
        return with_pin(",".join(filter(None, (
            wire, f"link_bandwidth_gbps={link.bits_per_second / 1e9:g},link_latency_us={LATENCY_US}"))),
            config, plan or [])

    def plan_of_record(self, config: str, link) -> list[str]:
        """The plan ``config``'s timing run on ``link`` recorded ([] for none, or no such run): the
        first timing run lets ``auto`` resolve it; every later run of that link pins it
        (:func:`pin`). Why: ``auto`` weighs the wire time against a codec time measured at
        start-up, and where two plans are predicted about equal the choice differs from run to run
        with the machine's load. TurboQuant at 1 Gbit/s on this machine chose fp32 in its timing
        run and all-gather in 2 of its first 3 quality runs: runs of one key trained 2 plans, and
        their losses were projected onto the fp32 timing run's step times."""
        if config not in LINK_PLANNED or not (path := self.path("timing", f"{config}@{link.name}")).exists():
            return []
        return json.loads(path.read_text()).get("plan") or []

    def timing_settings(self, config: str, link) -> dict:
        warm = STARTUP + self.args.timing_warm if switch_of(config, self.args.steps, self.args.powersgd_start) else 0
        steps = max(STARTUP, warm) + max(self.args.timing_main, 2 * diloco_h(config))
        return {**self.base(config), "config": config, "steps": steps, "switch": warm, "eval_every": 0,
                "lr": DEFAULT_LR[CONFIGS[config][1]], "seed": 0,
                "lowbit": self.overrides(config, link, self.plan_of_record(config, link)),
                "marks": ",".join(str(m) for m in sorted({STARTUP, max(STARTUP, warm), steps}))}

    def quality_settings(self, config: str, plan_link, lr: float, seed: int, eval_every: int | None = None) -> dict:
        return {**self.base(config), "config": config, "steps": self.args.steps, "lr": lr, "seed": seed,
                "switch": switch_of(config, self.args.steps, self.args.powersgd_start),
                "eval_every": eval_every or self.args.eval_every,
                "lowbit": self.overrides(config, plan_link, self.plan_of_record(config, plan_link)),
                "marks": ""}

    # ---- files --------------------------------------------------------------------------
    def path(self, kind: str, name: str) -> Path:
        return self.out / "runs" / kind / f"{name}.json"

    def load(self, path: Path, settings: dict) -> dict | None:
        if not path.exists():
            return None
        rec = json.loads(path.read_text())
        rec["settings"] = recorded_wire(rec.get("settings") or {})
        same = rec.get("settings") == settings or (path.parent.name == "timing" and self.chose_its_pin(rec, settings))
        return rec if same else None

    @staticmethod
    def chose_its_pin(rec: dict, settings: dict) -> bool:
        """Whether ``rec`` is the run that let ``auto`` choose the plan ``settings`` pin: the first
        timing run of a link (:meth:`plan_of_record`). Asked again, it is the same run, not one to
        make again pinned."""
        got = rec.get("settings") or {}
        chosen = with_pin(got.get("lowbit", ""), got.get("config", ""), rec.get("plan") or [])
        return got.get("lowbit") != chosen and {**got, "lowbit": chosen} == settings

    # ---- running ------------------------------------------------------------------------
    def _command(self, settings: dict, out: Path) -> list[str]:
        cmd = [sys.executable, "-m", "benchmarks.ttq.worker", "--out", str(out), "--timeout", "900"]
        for key, value in settings.items():
            if value != "" and value is not None:
                cmd += [f"--{key.replace('_', '-')}", str(value)]
        return cmd

    def run(self, kind: str, name: str, settings: dict, link=None, net: Network | None = None) -> dict | None:
        """One run (cached): ``net`` given, on its shaped link; else on loopback."""
        path = self.path(kind, name)
        if self.load_only:
            return self.load(path, settings)
        if self.args.skip_existing and (rec := self.load(path, settings)) is not None and \
                reusable(kind, rec, self.code, self.args.retime):
            return rec
        self.done_runs += 1
        elapsed = time.monotonic() - self.start
        if time.monotonic() > self.deadline:
            print(f"[{elapsed:7.1f}s] {kind} {name}: skipped (--max-minutes)", flush=True)
            return None
        eta = (f", ~{elapsed / (self.done_runs - 1) * (self.planned - self.done_runs + 1) / 60:.0f} min left"
               if self.done_runs > 1 and self.planned else "")
        print(f"[{elapsed:7.1f}s] ({self.done_runs}/{self.planned or '?'}) {kind} {name}{eta}", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        partial.unlink(missing_ok=True)
        cmd = self._command(settings, partial)
        env = {"TORCH_CPP_LOG_LEVEL": "ERROR", "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
        limit = 600 + 10 * settings["steps"] * (1 if net is None else 3)
        busy0, own0, t0 = cpu_busy_s(), own_cpu_s(), time.monotonic()
        echo = () if self.args.quiet else (0,)
        if net is not None:
            if net.link != link:
                net.set_link(link)
            result = net.run(cmd, timeout=limit, env=env, echo=echo, cwd=str(ROOT))
            ok, outputs = result.ok, [r.output for r in result.ranks]
        else:
            done = procs.launch([cmd] * 4, loopback_envs(env), timeout=limit, echo=echo, cwd=str(ROOT))
            ok, outputs = not done.timed_out and all(c == 0 for c in done.returncodes), done.outputs
        wall = time.monotonic() - t0
        if not ok or not partial.exists():
            tail = next((o for o in outputs if "Error" in o), outputs[0])[-1500:]
            print(f"    FAILED after {wall:.0f} s:\n{tail}", flush=True)
            return None
        rec = json.loads(partial.read_text())
        partial.unlink()
        rec.update(settings=settings, code=self.code, run_seconds=round(wall, 1),
                   date=time.strftime("%Y-%m-%d %H:%M:%S"),
                   other_load=round(max(0.0, (cpu_busy_s() - busy0) - (own_cpu_s() - own0)) /
                                    (wall * (os.cpu_count() or 1)), 3))
        path.write_text(json.dumps(rec) + "\n")
        last = f", val {rec['evals'][-1][2]:.4f}" if rec["evals"] else ""
        print(f"    {rec['steps']} steps, {sum(rec['step_s']):.1f} s of training{last}; {wall:.0f} s in all",
              flush=True)
        return rec


def split_wire(text: str) -> tuple[str, dict[str, str]]:
    """``--warmup-wire``'s form, ``fp32,lowbit_adam=bf16``: (the default wire, the exceptions by
    configuration)."""
    default, *pairs = [t.strip() for t in text.split(",")]
    return default, dict(pair.partition("=")[::2] for pair in pairs)


def parse_wire(text: str) -> str:
    """``--warmup-wire``: one wire for every :data:`WIRED` configuration (``bf16``, ``fp32``), or a
    default and per-configuration exceptions, ``fp32,lowbit_adam=bf16`` (a study moving to a new
    wire one configuration at a time keeps every row's runs consistent with themselves)."""
    default, exceptions = split_wire(text)
    wires = {"bf16", "fp32"}
    if default not in wires:
        raise argparse.ArgumentTypeError(f"--warmup-wire {text!r}: the first item is the default wire, one of "
                                         f"{sorted(wires)}, got {default!r}")
    for config, wire in exceptions.items():
        if config not in WIRED or wire not in wires | ({"int2"} if config in CODED else set()):
            raise argparse.ArgumentTypeError(
                f"--warmup-wire {text!r}: '{config}={wire}' is not CONFIG=WIRE with CONFIG one of {sorted(WIRED)} "
                f"and WIRE one of {sorted(wires)} (or int2 for {', '.join(sorted(CODED))})")
    return ",".join([default, *(f"{c}={w}" for c, w in exceptions.items())])


def parse_lrs(text: str) -> dict[str, float]:
    """``--lr lowbit_lamb=0.006,...``: configurations run at that learning rate, not swept (an
    earlier sweep's choice, kept where a configuration is run again with other settings, e.g. a
    new warm-up wire, rather than swept again at 4 runs of 15 minutes)."""
    out: dict[str, float] = {}
    for pair in filter(None, (t.strip() for t in text.split(","))):
        config, _, value = pair.partition("=")
        try:
            lr = float(value)
        except ValueError:
            lr = -1.0
        if config not in CONFIGS or not lr > 0:
            raise argparse.ArgumentTypeError(f"--lr {text!r}: {pair!r} is not CONFIG=LR with CONFIG a configuration "
                                             f"and LR > 0, e.g. lowbit_lamb=0.006")
        out[config] = lr
    return out


def wire_of(text: str, config: str) -> str:
    """The warm-up wire ``--warmup-wire`` (:func:`parse_wire`'s form) gives ``config``."""
    default, exceptions = split_wire(text)
    return exceptions.get(config, default)


def recorded_wire(settings: dict) -> dict:
    """A run's recorded settings, with the ``warmup_wire`` it ran with made explicit: a :data:`WIRED`
    run recorded before the field (2026-11-29) ran fp32, which is now ``warmup_wire=fp32``."""
    lowbit = settings.get("lowbit", "")
    if settings.get("config") not in WIRED or "warmup_wire=" in lowbit:
        return settings
    return {**settings, "lowbit": ",".join(filter(None, ("warmup_wire=fp32", lowbit)))}


def bound_configs(study: Study, configs: list[str]) -> list[str]:
    """The comm-free runs (:data:`BOUND`) of the references among ``configs``, unless ``--no-bound``."""
    return [] if getattr(study.args, "no_bound", False) else [calib for ref, calib in BOUND.items() if ref in configs]


def diloco_h(config: str) -> int:
    """H of a :data:`DILOCO` form (0 for any other configuration). Its timing run's main phase spans
    two rounds (steps STARTUP + 1 .. STARTUP + 2H hold both syncs), so the phase's mean step is the
    inner step plus the exchange amortized over H (over 2H − 1 steps: 1/H at H = 50 over-counts it 1 %)."""
    found = re.search(r"diloco_sync_every=(\d+)", DILOCO.get(config, ""))
    return int(found.group(1)) if found else 0


def loopback_envs(env: dict, nodes: int = 2, per_node: int = 2) -> list[dict]:
    """torchrun's variables for ``nodes`` x ``per_node`` ranks on 127.0.0.1 (no shaping)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = nodes * per_node
    return [{**os.environ, **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
             "WORLD_SIZE": str(world), "LOCAL_RANK": str(r % per_node), "LOCAL_WORLD_SIZE": str(per_node),
             "NODE_RANK": str(r // per_node), "GROUP_RANK": str(r // per_node), "GROUP_WORLD_SIZE": str(nodes),
             "ROLE_RANK": str(r), "ROLE_WORLD_SIZE": str(world), "PYTHONUNBUFFERED": "1"} for r in range(world)]


def code_fingerprint() -> str:
    """12 hex digits of a sha256 over every ``.py`` file of :data:`CODE` but :data:`NOT_RUN` (path and
    bytes, sorted):
    each run records it, so a timing run made by older code (a codec since made faster, say) is
    seen in the report and rerun by ``--retime``. Quality runs record it too, for provenance; their
    losses do not depend on speed-ups that keep the bits (the tests hold the codecs bit-exact)."""
    digest = hashlib.sha256()
    skip = [ROOT / name for name in NOT_RUN]
    for name in CODE:
        path = ROOT / name
        for f in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            if any(f.is_relative_to(x) for x in skip):
                continue
            digest.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:12]


def pin(config: str, plan: list[str]) -> str:
    """LowBitConfig overrides that fix a recorded ``plan`` (:func:`benchmarks.e2e.worker.resolved_plans`)
    instead of ``auto``: Lion Cub's ``Plan(mode='lp', bits=8, levels=63)`` -> ``lion_mode=lp,lion_bits=8``
    (the levels follow from the lane and the world size), TurboQuant's ``forms: fp32 x1`` ->
    ``turboquant_form=fp32``. Nothing ("": ``auto`` resolves it) for no plan, or for TurboQuant
    buckets of several forms (one field cannot pin a form per bucket)."""
    if not plan:
        return ""
    if config == "lowbit_lion":
        found = re.fullmatch(r"Plan\(mode='(\w+)', bits=(\d+), levels=\d+\)", plan[0])
        if found is None:
            raise ValueError(f"pin: cannot read Lion Cub's plan {plan[0]!r}")
        mode, bits = found.groups()
        return f"lion_mode={mode}" + (f",lion_bits={bits}" if mode in ("sign", "lp") else "")
    if config == "lowbit_turboquant":
        forms = {part.strip().split(" x")[0] for p in plan for part in p.removeprefix("forms:").split(",")}
        return f"turboquant_form={forms.pop()}" if len(forms) == 1 else ""
    return ""


def with_pin(overrides: str, config: str, plan: list[str]) -> str:
    """``overrides`` with :func:`pin`'s fields for ``plan`` appended (as they are where it pins nothing)."""
    return ",".join(filter(None, (overrides, pin(config, plan))))


def unplanned(kind: str, rec: dict) -> bool:
    """A timing run of a :data:`LINK_PLANNED` configuration that recorded no plan (the worker
    read it after teardown had detached the communicators, before 2026-11-27): it is run again,
    since :func:`quality_keys` needs its plan to tell whether the links share quality runs."""
    return kind == "timing" and rec.get("config") in LINK_PLANNED and not rec.get("plan")


def reusable(kind: str, rec: dict, code: str, retime: bool) -> bool:
    """Whether ``--skip-existing`` keeps a run whose settings match: not a timing run without
    its plan (:func:`unplanned`), nor, under ``--retime``, a timing run made by other code."""
    return not unplanned(kind, rec) and not (retime and kind == "timing" and rec.get("code") != code)


def quality_keys(study: Study, configs: list[str], timing: dict) -> dict[tuple[str, str], tuple[str, object]]:
    """(config, link name) -> (quality key, the link its runs are planned for): one key per
    configuration, one per distinct plan for :data:`LINK_PLANNED` ones."""
    keys = {}
    for c in configs:
        for link in study.links:
            if c not in LINK_PLANNED:
                keys[(c, link.name)] = (c, study.links[0])
                continue
            # an unrecorded plan ([] or no timing run yet) matches nothing: runs per link
            plan = (timing.get((c, link.name)) or {}).get("plan")
            same = next(ln for ln in study.links if ln == link or
                        (plan and (timing.get((c, ln.name)) or {}).get("plan") == plan))
            keys[(c, link.name)] = (f"{c}@{same.name}", same)
    return keys


def beyond_edge(final: dict[float, float], default: float) -> float | None:
    """The next learning rate to sweep when the best so far (:func:`best_lr`) is the lowest or
    the highest tried: half or twice it (an optimum at the sweep's edge is not known to be
    one); None when the best lies inside, or fewer than two were tried."""
    if len(final) < 2:
        return None
    best = best_lr(final, default)
    if best not in (min(final), max(final)):
        return None
    return float(f"{best * (0.5 if best == min(final) else 2):.3g}")


def centre_lr(config: str, chosen: dict[str, float]) -> float:
    """The centre of ``config``'s sweep: the example's default for an optimizer's reference
    (:data:`REFERENCE`) or while the reference has no chosen lr yet; otherwise that default
    times the factor the reference's own sweep moved by (its chosen lr / its default). On this
    model DDP + AdamW's sweep ended at a quarter of the default: sweeping every AdamW-family
    method around the default again would put each optimum at the low edge and cost up to two
    extension runs per method, where a sweep centred on the reference's lr brackets it."""
    optimizer = CONFIGS[config][1]
    ref = REFERENCE[optimizer]
    ref_lr = next((lr for key, lr in chosen.items() if key.split("@")[0] == ref), None)
    if config == ref or ref_lr is None:
        return DEFAULT_LR[optimizer]
    return float(f"{DEFAULT_LR[optimizer] * ref_lr / DEFAULT_LR[CONFIGS[ref][1]]:.3g}")


def lrs_of(centre: float, factors: list[float]) -> list[float]:
    return [float(f"{centre * f:.3g}") for f in factors]


def execute(study: Study, configs: list[str], seeds: list[int], factors: list[float], swept: list[str],
            validate: list[tuple[str, str]]) -> dict:
    """Every run of the study in order (timing, sweep, seeds, validation), or with
    ``study.load_only`` the ones that exist; what :func:`benchmarks.ttq.report.write` reads."""
    runs: dict = {"timing": {}, "sweep": {}, "centre": {}, "chosen": {}, "quality": {}, "full": [], "keys": {},
                  "bound": {}}
    with contextlib.nullcontext() if study.load_only else Network(nodes=2, ranks_per_node=2,
                                                                    link=study.links[0]) as net:
        for link in study.links:
            for c in configs:
                runs["timing"][(c, link.name)] = study.run("timing", f"{c}@{link.name}",
                                                           study.timing_settings(c, link), link, net)
            for calib in bound_configs(study, configs):
                runs["bound"][(calib, link.name)] = study.run("timing", f"{calib}@{link.name}",
                                                              study.timing_settings(calib, link), link, net)
        if getattr(study.args, "timing_only", False):
            return runs
        keys = quality_keys(study, configs, runs["timing"])
        runs["keys"] = {k: v[0] for k, v in keys.items()}
        # the references first (their chosen lr centres the others' sweeps), then in the given order
        order = sorted(dict.fromkeys(keys.values()), key=lambda kv: kv[0].split("@")[0] not in REFERENCE.values())
        fixed = getattr(study.args, "lr", None) or {}
        for key, plan_link in order:
            config = key.split("@")[0]
            sweeping = config in swept and config not in fixed
            centre = runs["centre"][key] = fixed.get(config) or centre_lr(config, runs["chosen"])
            lrs = lrs_of(centre, factors if sweeping else [1.0])
            final, runs["quality"][key] = {}, {}
            for lr in lrs:
                rec = study.run("quality", f"{key}_lr{lr:g}_seed{seeds[0]}",
                                study.quality_settings(config, plan_link, lr, seeds[0]))
                if rec and rec["evals"]:
                    final[lr] = rec["evals"][-1][2]
                    runs["quality"][key][(lr, seeds[0])] = rec
            for _ in range(study.args.sweep_extend if sweeping else 0):
                lr = beyond_edge(final, centre)
                if lr is None:
                    break
                rec = study.run("quality", f"{key}_lr{lr:g}_seed{seeds[0]}",
                                study.quality_settings(config, plan_link, lr, seeds[0]))
                if not (rec and rec["evals"]):
                    break
                final[lr] = rec["evals"][-1][2]
                runs["quality"][key][(lr, seeds[0])] = rec
            runs["sweep"][key] = final
            runs["chosen"][key] = best_lr(final, centre) if final else centre
        for seed in seeds[1:]:
            for key, plan_link in dict.fromkeys(keys.values()):
                config, lr = key.split("@")[0], runs["chosen"][key]
                rec = study.run("quality", f"{key}_lr{lr:g}_seed{seed}",
                                study.quality_settings(config, plan_link, lr, seed))
                if rec:
                    runs["quality"][key][(lr, seed)] = rec
        for config, link_name in validate:
            link = next((ln for ln in study.links if ln.name == link_name), None)
            if link is None or config not in configs:
                print(f"--validate {config}@{link_name}: not in this study's configs/links; skipped", flush=True)
                continue
            key, plan_link = keys[(config, link.name)]
            lr = runs["chosen"][key]
            rec = study.run("full", f"{config}@{link.name}_lr{lr:g}_seed{seeds[0]}",
                            {**study.quality_settings(config, plan_link, lr, seeds[0]),
                             "lowbit": study.overrides(config, link, study.plan_of_record(config, link))}, link, net)
            if rec:
                runs["full"].append(rec)
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ttq", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the smoke form of every stage (<= 10 min)")
    parser.add_argument("--configs", default=None, help=f"comma-separated, from {BASELINES + ALGORITHMS}")
    parser.add_argument("--links", default="1gbit,100mbit,10mbit")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", default=None)
    parser.add_argument("--lr-factors", default=None, help="the sweep: centre lr (centre_lr) x these (seed 0)")
    parser.add_argument("--sweep", default=None,
                        help="configs swept ('all' or comma-separated); others: their centre lr")
    parser.add_argument("--lr", type=parse_lrs, default={}, metavar="CONFIG=LR,...",
                        help="these configurations at this lr, not swept (an earlier sweep's choice)")
    parser.add_argument("--sweep-extend", type=int, default=None,
                        help="while a swept config's best lr is the lowest or highest tried, try half or twice it, "
                             "at most this many times (full study 4, --quick 0)")
    parser.add_argument("--validate", default=None, help="CONFIG@LINK,...: full runs on the link ('' for none)")
    parser.add_argument("--powersgd-start", default=None, help="PowerSGD fp32 warm-up: N or P%% (default torch's)")
    parser.add_argument("--model", default="", metavar="KEY=VALUE,...",
                        help=f"model/data changes to the preset's {MODEL} (e.g. d_model=64,layers=2)")
    parser.add_argument("--warmup-wire", default="bf16", type=parse_wire, metavar="WIRE[,CONFIG=WIRE...]",
                        help="LowBitConfig.warmup_wire (bf16 or fp32) of the configurations with an uncompressed "
                             "phase, and per-configuration exceptions (fp32,lowbit_adam=bf16); fp32: the runs made "
                             "before the field, 2026-11-29")
    parser.add_argument("--no-bound", action="store_true",
                        help="no comm-free timing runs (the bound each method is a fraction of)")
    parser.add_argument("--skip-existing", action="store_true", help="keep runs whose JSON has the same settings")
    parser.add_argument("--retime", action="store_true",
                        help="with --skip-existing: rerun the timing runs made by other code (code_fingerprint)")
    parser.add_argument("--max-minutes", type=float, default=24 * 60, help="start no run after this")
    parser.add_argument("--output", default=None, help="folder (default results/ttq, --quick results/ttq/quick)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and stop")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--timing-only", action="store_true",
                        help="only the timing runs (and comm-free bounds) of --configs on --links, kept in the "
                             "output's runs/timing; no quality run, no report (a form whose quality runs are made "
                             "elsewhere, e.g. benchmarks.ttq.diloco_sweep)")
    parser.add_argument("--quiet", action="store_true", help="no live output of rank 0")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    model = dict(preset["model"])
    for item in filter(None, args.model.split(",")):
        key, _, value = item.partition("=")
        if key not in MODEL:
            parser.error(f"--model: {key!r} is not one of {sorted(MODEL)}")
        model[key] = type(MODEL[key])(value)
    args.model = model
    out = Path(args.output) if args.output else (RESULTS / "quick" if args.quick else RESULTS)
    configs = args.configs.split(",") if isinstance(args.configs, str) else list(args.configs)
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}")
    configs = [c for c in configs if available(c)]
    args.val_batches, args.eval_every = preset["val_batches"], preset["eval_every"]
    for key in ("lr_warmup", "timing_warm", "timing_main"):
        setattr(args, key, preset[key])
    factors = [float(f) for f in args.lr_factors.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    swept = configs if args.sweep == "all" else [c for c in args.sweep.split(",") if c in configs]
    validate = [tuple(v.split("@")) for v in args.validate.split(",") if v]
    switch = {c: switch_of(c, args.steps, args.powersgd_start) for c in configs}
    short = {c: w for c, w in switch.items() if 0 < w <= STARTUP}
    if short:  # the timing runs time steps 1..STARTUP as start-up, at full precision
        parser.error(f"compression warm-ups {short} end within the {STARTUP} start-up steps the timing runs time "
                     f"at full precision; give --powersgd-start above {STARTUP} (or more --steps)")
    study = Study(args, out)
    command = " ".join(["python -m benchmarks.ttq", *(argv if argv is not None else sys.argv[1:])])
    settings = {"configs": configs, "links": [ln.name for ln in study.links], "steps": args.steps, "seeds": seeds,
                "lr_factors": factors, "sweep_extend": args.sweep_extend, "swept": swept, "validate": validate,
                "model": study.model,
                "eval_every": args.eval_every, "val_batches": args.val_batches, "lr_warmup": args.lr_warmup,
                "timing_warm": args.timing_warm, "timing_main": args.timing_main, "startup_steps": STARTUP,
                "powersgd": {**POWERSGD, "start_powerSGD_iter": switch_of("ddp_powersgd_adamw", args.steps,
                                                                        args.powersgd_start)},
                "switch": switch,
                "latency_us_for_plans": LATENCY_US, "default_lr": DEFAULT_LR, "code": study.code,
                "warmup_wire": args.warmup_wire, "fixed_lr": args.lr}
    if args.report_only:
        study.load_only = True
        before = json.loads((out / "ttq.json").read_text()) if (out / "ttq.json").exists() else None
        same = before is not None and all(before["settings"].get(k) == settings[k]
                                          for k in ("configs", "links", "warmup_wire", "seeds"))
        if same:  # the same study again: the date and duration of the run that made it
            settings.update({k: before["settings"][k] for k in ("date", "total_seconds", "report_only")
                             if k in before["settings"]})
            command = before["command"]
        else:  # another selection of the recorded runs: this command makes it, the runs say when they ran
            settings["report_only"] = True
        ttq_report.write(out, settings, command, machine(), execute(study, configs, seeds, factors, swept, validate))
        return 0
    n_quality = 0 if args.timing_only else sum(len(factors) - 1 + len(seeds) if c in swept else len(seeds)
                                               for c in configs)
    study.planned = (len(configs) + len(bound_configs(study, configs))) * len(study.links) + n_quality + len(validate)
    print(f"time to quality: {len(configs)} configs x links {settings['links']}; {args.steps} steps, seeds {seeds}, "
          f"lr x {factors} for {len(swept)} configs; ~{study.planned} runs (more where an auto plan differs by "
          f"link, and up to {args.sweep_extend} per swept config whose best lr is at the sweep's edge); "
          f"results -> {out}", flush=True)
    done = {kind: len(list((out / "runs" / kind).glob("*.json"))) for kind in ("timing", "quality", "full")}
    print("kept so far (reused where their settings match): " + ", ".join(f"{n} {k}" for k, n in done.items()),
          flush=True)
    if args.dry_run:
        return 0
    try:
        require_root()
    except NetemError as err:
        print(f"benchmarks.ttq.driver: {err}", file=sys.stderr)
        return 2
    try:
        runs = execute(study, configs, seeds, factors, swept, validate)
    except NetemError as err:
        print(f"benchmarks.ttq.driver: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("benchmarks.ttq.driver: interrupted; ranks killed, namespaces removed", file=sys.stderr)
        return 130
    settings["total_seconds"] = round(time.monotonic() - study.start, 1)
    if args.timing_only:
        for (config, link), rec in runs["timing"].items():
            if rec:
                step = phase_times(rec["step_s"], 0)["main"]["mean"]
                print(f"{config}@{link}: {step:.3f} s/step (main phase)", flush=True)
        return 0
    ttq_report.write(out, settings, command, machine(), runs)
    print(f"[{time.monotonic() - study.start:7.1f}s] wrote {out}/ttq.json, ttq.md, ttq_loss.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
