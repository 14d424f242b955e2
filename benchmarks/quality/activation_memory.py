"""Activation compression on the GPT example: memory, step time and loss, with vs without.

Trains ``examples/gpt_lion.py``'s GPT (its model, data and AdamW schedule) in one process,
plain PyTorch (no Trainer), twice from the same seed and data order: with every linear
layer but the head a :class:`lowbit_strategy.nn.TurboQuantLinear` (4-bit codes of its
input kept for backward) and without. Prints two markdown tables:

1. **Memory and time** of a training step (forward, backward, optimizer step):
   saved-tensor bytes of the forward pass (:class:`~lowbit_strategy.nn.SavedTensorMeter`:
   all of them, and the linear layers' inputs or their codes), the peak of memory
   allocated during the step above what was allocated before it (CPU: the profiler's
   allocation events, ``torch.profiler.profile(profile_memory=True)``; CUDA:
   ``torch.cuda.max_memory_allocated``), and the median step time over ``--time-steps``
   steps (after 3 warm-up steps). Below the table: the memory the codecs keep between
   steps (their cached rotation signs, allocated once per input size, before the step).
2. **Loss at equal steps**: mean training loss of the last 20 of ``--steps`` steps and the
   validation loss after them, for AdamW and (if the package has it) TurboQuantAdamW, each
   with and without compression. In one process TurboQuantAdamW has nothing to send and
   is ``torch.optim.AdamW`` (its docstring), so its rows show compression on top of that
   optimizer, not momentum compression; momentum compression needs a ``lowbit_turboquant``
   run over several processes.

Not a test: the figures depend on the machine (the step time on a shared CPU especially).

    python -m benchmarks.quality.activation_memory [--steps 300] [--device cpu] [--threads 2] [--bits 4] [--block N]
    python -m benchmarks.quality.activation_memory --skip-memory --optimizers adamw --bits 8   # a control
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import lowbit_strategy  # noqa: E402
from examples.gpt_lion import GPT, Windows, stdlib_bytes  # noqa: E402
from lowbit_strategy.nn import SavedTensorMeter, TurboQuantLinear, compress_activations  # noqa: E402


def build(args, compress: bool, optimizer: str):
    torch.manual_seed(args.seed)
    model = GPT(seq=args.seq, d=args.d_model, layers=args.layers, lr=args.lr, optimizer="adamw",
                total_steps=args.steps).to(args.device)
    if compress:
        compress_activations(model, bits=args.bits, block=args.block)
    cfg = model.configure_optimizers()  # AdamW + the example's warm-up/cosine schedule
    opt, sched = cfg["optimizer"], cfg["lr_scheduler"]["scheduler"]
    if optimizer == "turboquant_adamw":
        opt = lowbit_strategy.TurboQuantAdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, sched.lr_lambdas[0])
    return model, opt, sched


def batches(args, tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    loader = DataLoader(Windows(tokens, args.seq), batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=gen)
    while True:
        yield from loader


def step(model, opt, sched, batch, device):
    x, y = (t.to(device) for t in batch)
    loss = model._loss((x, y))
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def profiler_peak(fn) -> int:
    """Peak bytes allocated during ``fn()`` above what was allocated when it started: the
    running sum, in time order, of every profiler event's *self* memory (an op's own net
    allocations, children excluded; ``[memory]`` events are allocations and frees outside
    any op). Transient buffers allocated and freed inside one op are not seen."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def measure(args, tokens, compress: bool) -> dict:
    model, opt, sched = build(args, compress, "adamw")
    data = batches(args, tokens, args.seed)
    for _ in range(3):  # warm-up: optimizer state allocated, codec signs drawn
        step(model, opt, sched, next(data), args.device)
    x, y = (t.to(args.device) for t in next(data))
    with SavedTensorMeter(model) as meter:
        loss = model._loss((x, y))
    loss.backward()
    opt.zero_grad(set_to_none=True)
    st = meter.stats
    batch = next(data)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step(model, opt, sched, batch, args.device)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = profiler_peak(lambda: step(model, opt, sched, batch, args.device))
    times = []
    for _ in range(args.time_steps):
        b = next(data)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step(model, opt, sched, b, args.device)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    codecs = {id(m.codec): m.codec for m in model.modules() if isinstance(m, TurboQuantLinear)}
    signs = sum(t.numel() * t.element_size() for c in codecs.values() for t in c._signs.values())
    return {"saved": st.total_bytes, "linear": st.linear_input_bytes, "peak": peak, "signs": signs,
            "ms": 1e3 * statistics.median(times), "derived_without": st.total_bytes_uncompressed}


@torch.no_grad()
def val_loss(model, tokens, args, batches_n=20) -> float:
    loader = DataLoader(Windows(tokens, args.seq), batch_size=args.batch_size)
    losses = []
    for i, (x, y) in enumerate(loader):
        if i == batches_n:
            break
        losses.append(float(model._loss((x.to(args.device), y.to(args.device)))))
    return sum(losses) / len(losses)


def train(args, train_tokens, val_tokens, compress: bool, optimizer: str) -> dict:
    model, opt, sched = build(args, compress, optimizer)
    data = batches(args, train_tokens, args.seed)
    losses = [float(step(model, opt, sched, next(data), args.device)) for _ in range(args.steps)]
    return {"train": sum(losses[-20:]) / len(losses[-20:]), "val": val_loss(model, val_tokens, args),
            "finite": all(math.isfinite(v) for v in losses)}


def mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300, help="training steps of the loss comparison (0: skip it)")
    p.add_argument("--time-steps", type=int, default=10)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--data-mb", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bits", type=int, default=4, help="TurboQuantLinear code width")
    p.add_argument("--block", type=int, default=None, help="TurboQuantLinear rotation block (default: its rule)")
    p.add_argument("--optimizers", nargs="+", default=["adamw", "turboquant_adamw"],
                   choices=["adamw", "turboquant_adamw"], help="the loss comparison's optimizers")
    p.add_argument("--skip-memory", action="store_true", help="only the loss comparison")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokens = stdlib_bytes(int(args.data_mb * 2**20))
    split = int(len(tokens) * 0.9)
    train_tokens, val_tokens = tokens[:split], tokens[split:]

    print(f"\nTurboQuantLinear: bits={args.bits}, block={args.block or 'default rule'}")
    if not args.skip_memory:
        memory_table(args, train_tokens)
    if args.steps > 0:
        loss_table(args, train_tokens, val_tokens)


def memory_table(args, train_tokens) -> None:
    rows = {name: measure(args, train_tokens, c) for name, c in (("nn.Linear", False), ("TurboQuantLinear", True))}
    peak_what = "torch.cuda.max_memory_allocated" if args.device.startswith("cuda") else "profiler"
    print(f"\nGPT d={args.d_model} layers={args.layers} seq={args.seq} batch={args.batch_size}, {args.device}, "
          f"{torch.get_num_threads()} threads, fp32\n")
    print(f"| linear layers | saved tensors MiB | linear inputs MiB | step peak MiB ({peak_what}) | step ms (median) |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {mib(r['saved'])} | {mib(r['linear'])} | {mib(r['peak'])} | {r['ms']:.0f} |")
    a, b = rows["nn.Linear"], rows["TurboQuantLinear"]
    print(f"| ratio | {a['saved'] / b['saved']:.2f}x | {a['linear'] / b['linear']:.2f}x | "
          f"{a['peak'] / b['peak']:.2f}x | {b['ms'] / a['ms']:.2f}x time |")
    print(f"\nPersistent, outside the step: the shared codecs' cached rotation signs, {mib(b['signs'])} MiB "
          "(one float32 per element of each distinct linear-input size, for the whole model).")
    print(f"(meter's 'without' derived from the compressed pass: {mib(b['derived_without'])} MiB; "
          f"measured on nn.Linear: {mib(a['saved'])} MiB)")


def loss_table(args, train_tokens, val_tokens) -> None:
    have_tq = hasattr(lowbit_strategy, "TurboQuantAdamW")
    optimizers = [o for o in args.optimizers if o != "turboquant_adamw" or have_tq]
    print(f"\nLoss after {args.steps} steps (same seed and batches; train: mean of the last 20 steps; "
          f"val: 20 held-out batches)\n")
    print("| optimizer | linear layers | train loss | val loss | val gap |")
    print("|---|---|---:|---:|---:|")
    for opt_name in optimizers:
        base = None
        for name, c in (("nn.Linear", False), ("TurboQuantLinear", True)):
            r = train(args, train_tokens, val_tokens, c, opt_name)
            base = r["val"] if base is None else base
            print(f"| {opt_name} | {name} | {r['train']:.4f} | {r['val']:.4f} | {r['val'] - base:+.4f} |", flush=True)
    if "turboquant_adamw" in args.optimizers and not have_tq:
        print("\n(lowbit_strategy.TurboQuantAdamW not found: combined case not measured)")


if __name__ == "__main__":
    main()
