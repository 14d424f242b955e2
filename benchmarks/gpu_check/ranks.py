"""Part 3: several ranks on the one GPU. NCCL refuses two ranks on one device; gloo does not:
it runs allreduce, all-gather, broadcast and all-to-all on CUDA tensors through pinned host
buffers and CUDA streams and events, so gloo ranks sharing the GPU run the library's real
CUDA path (kernels queued asynchronously, deferred phases on the side stream, futures that
complete before the data may be read unless the stream rules are kept).

Launches :mod:`.ranks_worker` as 2 processes (flat) and 4 processes (flat, and 2 nodes x 2),
backend ``cpu:gloo,cuda:gloo``, on CUDA and, at the same time, the same runs on CPU; checks
every run of every algorithm through plain DDP and Lightning, and sharded (FSDP2 inside each
node, the 2 x 2 layout only: a flat layout has one node and nothing to exchange across), the
worker's docstring says what each check means, and compares each CUDA run with its CPU twin:

* the loss at every step within :data:`LOSS_TOL` (relative), and
* the final parameters: ``|cuda - cpu| / |cpu - init|`` (the disagreement over the size of
  the update the run made) within :data:`UPDATE_TOL`. Sign-based updates differ where float
  rounding flips a sign, so this is a bound, not bit equality; reading a buffer before its
  copy has landed gives garbage, far outside it.

``--cpu``: the CPU runs alone (2 flat, 4 as 2 x 2), which checks this script, not CUDA.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.gpu_check import ROOT, Part, table
from benchmarks.gpu_check.ranks_worker import FRONTS, LAYOUTS, RUNS, mlp, runs_on

LOSS_TOL = 0.05
UPDATE_TOL = 0.5
#: seconds a launch group may take before it is killed (a hang is a failure, not a wait):
#: 2 CPU cores run a group in ~15 s, so this is a hang's bound, not a run's time
LAUNCH_TIMEOUT_S = 150


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, layouts: str, cpu: bool, steps: int, out: Path, logs_dir: Path) -> list[subprocess.Popen]:
    port = _port()
    procs = []
    for rank in range(world):
        env = {k: v for k, v in os.environ.items() if k not in ("LOWBIT_EMULATE_NCCL", "LOCAL_WORLD_SIZE",
                                                                 "GROUP_RANK", "TRITON_INTERPRET")}
        env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "benchmarks.gpu_check.ranks_worker", "--steps", str(steps), "--layouts", layouts,
               "--out", str(out)] + (["--cpu"] if cpu else [])
        # to files, not pipes: a rank blocked on a full pipe would hang its peers in a collective
        stem = logs_dir / f"P{world}-{layouts.replace(',', '+')}-{'cpu' if cpu else 'cuda'}-rank{rank}"
        logs = (open(f"{stem}.out", "w+"), open(f"{stem}.err", "w+"))
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logs[0], stderr=logs[1], text=True)
        proc.logs = logs
        procs.append(proc)
    return procs


def _read(f) -> str:
    f.flush()
    f.seek(0)
    text = f.read()
    f.close()
    return text


def _collect(name: str, procs: list[subprocess.Popen], deadline: float, calls: Counter) -> tuple[list[dict], list[str]]:
    """Rank outputs: the records rank 0 printed, and one failure line per failed rank; the
    launch's collective counts are added to ``calls``."""
    records, failures = [], []
    for rank, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            proc.wait()
            failures.append(f"{name}: rank {rank} still running after {LAUNCH_TIMEOUT_S} s (killed)")
        stdout, stderr = (_read(f) for f in proc.logs)
        for line in stdout.splitlines():
            if line.startswith("RANKCHECK "):
                records.append(json.loads(line[len("RANKCHECK "):]))
            elif line.startswith("RANKCOLLECTIVES "):
                calls.update(json.loads(line[len("RANKCOLLECTIVES "):]))
            elif line.startswith("RANKFAIL "):
                said = json.loads(line[len("RANKFAIL "):])
                failures.append(f"{name}: {said['front_end']} {said['run']} {said['layout']} rank {said['rank']}: "
                                f"{said['error']}")
        if proc.returncode not in (0, None) and not any(f"rank {rank}" in f for f in failures):
            tail = " | ".join(stderr.strip().splitlines()[-6:])
            failures.append(f"{name}: rank {rank} exited {proc.returncode}: {tail[-700:]}")
    return records, failures


def _key(r: dict) -> tuple:
    return r["front_end"], r["run"], r["layout"], r["world_size"]


def compare(cuda: dict, cpu: dict, params: Path, init: torch.Tensor) -> dict:
    """The CUDA run against its CPU twin: the largest relative loss gap over the steps and
    the final parameters' disagreement over the CPU run's update (module docstring)."""
    a, b = torch.tensor(cuda["losses"]), torch.tensor(cpu["losses"])
    loss_gap = float(((a - b).abs() / b.abs().clamp_min(1e-6)).max()) if len(a) == len(b) else float("inf")
    pa, pb = torch.load(params / f"{cuda['params']}.pt"), torch.load(params / f"{cpu['params']}.pt")
    update_gap = float((pa - pb).norm() / (pb - init).norm().clamp_min(1e-12))
    return {"loss_gap": loss_gap, "update_gap": update_gap,
            "ok": loss_gap <= LOSS_TOL and update_gap <= UPDATE_TOL}


def check(r: dict, steps: int) -> list[str]:
    """What failed in one run's record (empty when it passed)."""
    name = f"{r['device'].split(':')[0]} {r['front_end']} {r['run']} {r['layout']} P={r['world_size']}"
    bad = []
    losses = [v for i, v in enumerate(r["losses"]) if i != r["nan_step"]]
    if len(r["losses"]) != steps:
        bad.append(f"{name}: {len(r['losses'])} steps recorded, not {steps}")
    if not r["identical"]:
        bad.append(f"{name}: replicas differ")
    if not (sum(losses[-3:]) < sum(losses[:3])):
        bad.append(f"{name}: loss did not fall ({losses[:3]} -> {losses[-3:]})")
    if r["nan_skipped"] is not True:
        bad.append(f"{name}: a NaN on rank 1 at step {r['nan_step']} was not skipped on every rank")
    if r["backward_reads"] or r["backward_syncs"]:
        bad.append(f"{name}: {r['backward_reads']} host reads and {r['backward_syncs']} CUDA syncs during backward; "
                   f"first: {' / '.join(r['where'])[-400:]}")
    if r["front_end"] == "ddp" and r["run"] != "bitdp" and r["step_reads_max"] > 1:
        bad.append(f"{name}: {r['step_reads_max']} host reads in one optimizer.step() (at most 1 by design)")
    return bad


def run(args) -> Part:
    part = Part("ranks", "3. Several ranks on the one GPU (gloo, CUDA tensors)")
    if not args.cpu and not torch.cuda.is_available():
        part.failures.append("no CUDA device")
        return part
    launches = [(2, "flat"), (4, "flat,2x2")] if not args.cpu else [(2, "flat"), (4, "2x2")]
    devices = ["cpu"] if args.cpu else ["cuda", "cpu"]
    records, failures = [], []
    collectives: Counter = Counter()  # torch.distributed call (tensor device) -> calls, every launch
    logs_dir = args.out / "ranks-logs"  # every rank's stdout and stderr, kept for a failure's diagnosis
    logs_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        params = Path(tmp)
        # CUDA launches and their CPU twins run at once on a GPU machine (it has the cores);
        # on --cpu one launch at a time
        groups = [[(w, lay, dev) for dev in devices] for w, lay in launches] if not args.cpu else \
            [[(w, lay, "cpu")] for w, lay in launches]
        for group in groups:
            deadline = time.monotonic() + LAUNCH_TIMEOUT_S
            started = [(f"{dev} P={w} {lay}", _launch(w, lay, dev == "cpu", args.steps, params, logs_dir))
                       for w, lay, dev in group]
            print(f"   launched {', '.join(n for n, _ in started)}", flush=True)
            for name, procs in started:
                got, bad = _collect(name, procs, deadline, collectives)
                records += got
                failures += bad
                print(f"   {name}: {len(got)} runs, {len(bad)} failed launches", flush=True)
        for r in records:
            failures += check(r, args.steps)
        init = torch.cat([p.detach().reshape(-1) for p in mlp().parameters()])
        cpu = {_key(r): r for r in records if r["device"] == "cpu"}
        gaps = {}
        for r in records:
            if r["device"] != "cpu" and _key(r) in cpu:
                gaps[_key(r)] = g = compare(r, cpu[_key(r)], params, init)
                if not g["ok"]:
                    failures.append(f"cuda {' '.join(map(str, _key(r)))}: CPU twin differs (loss gap "
                                    f"{g['loss_gap']:.3g} > {LOSS_TOL} or update gap {g['update_gap']:.3g} > "
                                    f"{UPDATE_TOL})")
    expected = len(RUNS) * len(devices) * sum(
        runs_on(front, lay) for _, lays in launches for lay in lays.split(",") for front in FRONTS)
    if len(records) != expected:
        failures.append(f"{len(records)} runs reported, {expected} expected")
    part.failures = failures
    part.data = {"records": records, "collectives": dict(collectives),
                 "cuda_vs_cpu": {" ".join(map(str, k)): v for k, v in gaps.items()},
                 "loss_tol": LOSS_TOL, "update_tol": UPDATE_TOL, "layouts": dict(LAYOUTS)}
    head = ["torch.distributed call (tensor device)", "calls, every launch (the checks' own included)"]
    part.markdown = _markdown(records, gaps, args) + "\n\n" + table(head, sorted(collectives.items())) + (
        "\n\nEvery collective the library calls on tensors ran on them where they live: none is staged "
        "through CPU by a wrapper. Object collectives (the setup handshake, the layout) run on CPU tensors "
        "by design (gloo's object path).")
    return part


def _markdown(records: list[dict], gaps: dict, args) -> str:
    rows = []
    for r in sorted(records, key=lambda r: (r["device"], r["world_size"], r["layout"], r["front_end"], r["run"])):
        g = gaps.get(_key(r)) if r["device"] != "cpu" else None
        losses = [v for i, v in enumerate(r["losses"]) if i != r["nan_step"]]
        rows.append([r["run"], r["front_end"], r["device"].split(":")[0], r["world_size"], r["layout"],
                     "yes" if r["identical"] else "**NO**", f"{losses[0]:.3f} → {losses[-1]:.3f}",
                     "yes" if r["nan_skipped"] else "**NO**", f"{r['backward_reads']} / {r['backward_syncs']}",
                     r["side_stream_phases"], f"{r['fp32_bytes_per_step'] / max(1.0, r['bytes_per_step']):.1f}×",
                     f"{r['ms_per_step']:.1f}",
                     f"{g['loss_gap']:.1e} / {g['update_gap']:.2f}" if g else "–"])
    head = ["run", "front end", "device", "P", "layout", "replicas identical", "loss", "NaN skipped everywhere",
            "backward host reads / CUDA syncs", "side-stream phases", "fp32 bytes ÷ sent", "ms/step",
            "vs CPU: loss gap / update gap"]
    note = (f"\n\n{args.steps} steps per run, rank 1's loss NaN at step {args.steps // 2}; "
            "backend `cpu:gloo,cuda:gloo`, "
            f"one GPU shared by every rank. The CPU twin is the same run on CPU processes; tolerances: loss "
            f"{LOSS_TOL:.0%} at every step, final-parameter disagreement ≤ {UPDATE_TOL} of the update. "
            "Side-stream phases: deferred second phases run on the CUDA side stream (0 on CPU by construction; "
            "the forms without a second phase have none).")
    if args.cpu:
        note += " **--cpu**: CPU processes only; this checks the script, not CUDA."
    return table(head, rows) + note
