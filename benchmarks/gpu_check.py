"""``make gpu-check``: the first command to run on a machine with GPUs.

No GPU has ever been lent to this project: its CUDA behaviour is established by construction
and by CPU tests that reproduce NCCL's semantics (README, "GPU status"). This checks what only
a GPU can show, and prints a report:

1. the CUDA-only tests: the Triton kernels compiled for this GPU, bit-exact against the torch
   codec (``tests/codecs/test_turboquant_triton.py``, without ``TRITON_INTERPRET``);
2. the kernel benchmark (``benchmarks.turboquant_kernels``): GB/s against the device's peak;
3. a short NCCL training run of every registered algorithm on every visible GPU (``torchrun``,
   one process per GPU, plain DDP front end): replicas identical after every step, the loss
   falling, bytes per step against DDP's fp32 allreduce, step time;
4. the codec timings on this GPU (:func:`lowbit_strategy.plan.measure.measure_codecs`),
   written to ``benchmarks/results/gpu/codecs.json`` (:func:`write_codecs`), which
   ``lowbit-plan`` reads when present: its predictions then use this GPU's codec times, not
   none, nor this CPU's.

On a machine without a GPU it says so and exits 0. ``--cpu`` runs part 3 on two CPU
processes over gloo instead (a check of this script, not of CUDA).

    python -m benchmarks.gpu_check [--steps 30] [--cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
#: where ``lowbit-plan`` looks for a GPU's codec times (``lowbit_strategy.plan.cli.GPU_CODECS``)
CODECS_JSON = ROOT / "benchmarks" / "results" / "gpu" / "codecs.json"


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


def _codecs() -> tuple[str, bool, str]:
    """Part 4: time the codecs on GPU 0 and write :data:`CODECS_JSON`."""
    from lowbit_strategy.plan.measure import measure_codecs

    print("== codec timings for lowbit-plan", flush=True)
    try:
        ns, device = measure_codecs("cuda")
    except Exception as exc:  # a report line, not a crash: parts 1-3 still report
        return "codec timings", False, f"{type(exc).__name__}: {exc}"
    write_codecs(ns, device)
    last = f"wrote {CODECS_JSON.relative_to(ROOT)}: " + ", ".join(f"{k} {v:.3g}" for k, v in sorted(ns.items()))
    print(last, flush=True)
    return "codec timings", True, last

#: algorithm -> (LowBitConfig fields, optimizer): each registered algorithm's default form
RUNS = {
    "lion": ({"algorithm": "lion"}, "lion"),
    "bitdp": ({"algorithm": "bitdp"}, "adamw"),
    "onebit_adam": ({"algorithm": "onebit_adam"}, "onebit_adam"),
    "onebit_lamb": ({"algorithm": "onebit_lamb"}, "onebit_lamb"),
    "turboquant": ({"algorithm": "turboquant"}, "turboquant"),
}


def _optimizer(name: str, params, steps: int):
    import lowbit_strategy as lb

    warm = max(2, steps // 5)
    if name == "lion":
        return lb.Lion(params, lr=3e-4)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "onebit_adam":
        return lb.OneBitAdam(params, lr=1e-3, freeze_step=warm)
    if name == "onebit_lamb":
        return lb.OneBitLamb(params, lr=1e-3, freeze_step=warm)
    return lb.TurboQuantAdamW(params, lr=1e-3, warmup_steps=warm)


def _worker(args) -> None:
    """One rank of part 3 (launched by torchrun): every algorithm in turn, a JSON line each."""
    import torch.distributed as dist
    from torch import nn

    import lowbit_strategy as lb
    from lowbit_strategy.collectives import wire

    cuda = not args.cpu
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    data = torch.randn(64, 256, generator=gen)
    target = torch.randint(0, 16, (64,), generator=gen)
    for algo, (fields, opt_name) in RUNS.items():
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 16))
        ddp = nn.parallel.DistributedDataParallel(net.to(device), device_ids=[local] if cuda else None)
        opt = _optimizer(opt_name, ddp.parameters(), args.steps)
        sync = lb.attach(ddp, [opt], lb.LowBitConfig(bucket_size_mb=1.0, **fields))
        losses, identical, start = [], True, None
        for step in range(args.steps):
            if step == 2:
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
            idx = torch.arange(8) + 8 * ((step * world + rank) % 8)
            out = nn.functional.cross_entropy(ddp(data[idx].to(device)), target[idx].to(device))
            opt.zero_grad()
            out.backward()
            opt.step()
            losses.append(float(out.detach()))
            flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
            every = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(every, flat)
            identical = identical and all(torch.equal(every[0], e) for e in every[1:])
        if cuda:
            torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / max(1, args.steps - 2) if start is not None else float("nan")
        sent = sum(log.bytes_sent for log in sync.traffic_logs())
        numel = sum(p.numel() for p in ddp.parameters())
        sync.detach()
        if rank == 0:
            record = {"algorithm": algo, "world_size": world, "device": str(device), "identical": identical,
                      "first_loss": sum(losses[:3]) / 3, "last_loss": sum(losses[-3:]) / 3,
                      "bytes_per_step": sent / args.steps, "ddp_bytes_per_step": wire.allreduce_bytes(4 * numel, world),
                      "ms_per_step": 1e3 * seconds}
            print("GPUCHECK " + json.dumps(record), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _training(args) -> list[dict]:
    procs = 2 if args.cpu else torch.cuda.device_count()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs), "--master-port",
           str(_free_port()), "-m", "benchmarks.gpu_check", "--worker", "--steps", str(args.steps)]
    cmd += ["--cpu"] if args.cpu else []
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("LOWBIT_EMULATE_NCCL", None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the training runs failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads(line[len("GPUCHECK "):]) for line in proc.stdout.splitlines() if line.startswith("GPUCHECK ")]


def _step(title: str, cmd: list[str], env: dict) -> tuple[str, bool, str]:
    print(f"== {title}: {' '.join(cmd)}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
    print("\n".join(tail), flush=True)
    return title, proc.returncode == 0, tail[-1] if tail else ""


def report(rows: list[dict]) -> str:
    lines = ["| algorithm | ranks | device | replicas identical | loss first -> last | bytes/step | vs DDP fp32 | ms/step |",
             "|---|---:|---|---|---|---:|---:|---:|"]
    for r in rows:
        ratio = r["ddp_bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else float("nan")
        lines.append(f"| {r['algorithm']} | {r['world_size']} | {r['device']} | {'yes' if r['identical'] else 'NO'} | "
                     f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} | {r['bytes_per_step'] / 1024:.1f} KiB | "
                     f"{ratio:.1f}x | {r['ms_per_step']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--cpu", action="store_true", help="run the training part on 2 CPU processes (gloo)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        sys.stdout.flush()
        sys.stderr.flush()
        # without interpreter finalization: gloo's threads can abort it ("terminate called
        # without an active exception") after a finished run, as the examples found
        os._exit(0)
    if not args.cpu and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here, nothing to check. Without a GPU the project is verified by the CPU "
              "suite (NCCL's completion semantics emulated, Triton kernels in the interpreter); see the README's "
              "'GPU status'.")
        return
    results = []
    if not args.cpu:
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "LOWBIT_EMULATE_NCCL")}
        results.append(_step("Triton kernels on this GPU, bit-exact against torch",
                             [sys.executable, "-m", "pytest", "-q", "tests/codecs/test_turboquant_triton.py"], env))
        results.append(_step("kernel benchmark", [sys.executable, "-m", "benchmarks.turboquant_kernels"], env))
        results.append(_codecs())
    with tempfile.TemporaryDirectory():
        rows = _training(args)
    ok = all(r["identical"] and r["last_loss"] < r["first_loss"] for r in rows) and len(rows) == len(RUNS)
    print("\n" + report(rows))
    if args.cpu:
        print("\n(--cpu: CPU processes over gloo; this checks the script, not CUDA)")
    print("\ngpu-check summary:")
    for title, passed, last in results:
        print(f"  {'ok  ' if passed else 'FAIL'} {title}: {last}")
    print(f"  {'ok  ' if ok else 'FAIL'} NCCL training of every algorithm ({len(rows)} runs): replicas identical, "
          "loss falling")
    if not ok or not all(passed for _, passed, _ in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
