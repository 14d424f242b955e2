"""Throughput of each codec on this machine (CPU, and CUDA when one is present).

Prints a table of GB/s, counting the bytes of the float32 input (or of the codes, for
pack/unpack; of the packed votes, for the majority; of the float32 output, for the ±1
decode) processed per second; the median of several timed repetitions after a warm-up.
Not a test: figures depend on the machine.

Each figure is also shown as a fraction of the memory-bound yardstick, ``clone()`` of the
same float32 input (one read and one write of every value): a codec that reads each value
once and writes a code a quarter its size or less can run at about that speed, so the
fraction says how far a codec is from a single streaming pass.

Timing: wall clock by default; ``--clock cpu`` times the calling thread's CPU time
(``time.thread_time``: user and kernel, page faults included), which on a shared machine
leaves out the time other processes hold the core. With ``--threads 1`` every op runs in
the calling thread, so the two clocks measure the same work; with more threads ``cpu``
would miss the other threads' share, so it requires ``--threads 1``.

    python -m benchmarks.codecs [--numel 16777216] [--repeat 5] [--threads N] [--clock cpu]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lowbit_strategy.codecs import (
    TurboQuantCodec,
    bits,
    channel_encode,
    lp_quantize,
    majority_bits,
    scaled_sign_compress,
    scaled_sign_decode,
    sign_bits,
    sign_bits_packed,
    signs_from_bits,
)

YARDSTICK = "torch.clone (memory-bound yardstick)"


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def _time(fn, repeat: int, device: torch.device, clock=time.perf_counter) -> float:
    for _ in range(2):  # the first calls also grow the allocator's heap (page faults)
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        clock = time.perf_counter  # the GPU's time is not the thread's
    samples = []
    for _ in range(repeat):
        start = clock()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(clock() - start)
    return statistics.median(samples)


def _vote_cases(n: int, device: torch.device):
    """1-bit majority of P ranks' packed votes over ``n`` elements, counted in vote bytes."""
    out = []
    for p in (2, 4, 8):
        words = torch.randint(0, 256, (p, n // 8), device=device, dtype=torch.uint8)
        out.append((f"majority_bits P={p}", lambda w=words: majority_bits(w, 1), words.nbytes))
    return out


def cases(n: int, device: torch.device):
    """(name, callable, bytes processed) for every codec; the yardstick first."""
    x = torch.randn(n, device=device)
    rows = x.view(-1, 1024)
    packed_signs = sign_bits_packed(x, 1)
    error = torch.zeros(n, device=device)
    scale1 = torch.ones(1, device=device)
    out = [
        (YARDSTICK, lambda: x.clone(), x.nbytes),
        ("sign_bits", lambda: sign_bits(x, 1), x.nbytes),
        ("sign_bits_packed", lambda: sign_bits_packed(x, 1), x.nbytes),
        ("signs_from_bits (fp32 out)", lambda: signs_from_bits(packed_signs, n), x.nbytes),
        ("lp_quantize p=1 8bit", lambda: lp_quantize(x, 8, 1), x.nbytes),
        ("lp_quantize p=0 8bit", lambda: lp_quantize(x, 8, 0), x.nbytes),
        ("lp_quantize p=inf 8bit", lambda: lp_quantize(x, 8, float("inf")), x.nbytes),
        ("channel_encode 1bit", lambda: channel_encode(rows, 1), x.nbytes),
        ("channel_encode 2bit", lambda: channel_encode(rows, 2), x.nbytes),
        # 1-bit Adam/LAMB's worker step: error added, signs + scale, error updated in place
        ("scaled_sign_compress", lambda: scaled_sign_compress(x, error), x.nbytes),
        ("scaled_sign_decode (fp32 out)", lambda: scaled_sign_decode(packed_signs, scale1, n), x.nbytes),
    ]
    # TurboQuant's encoder (rotation, block RMS, 4-bit levels, packing) and decoder
    turbo = TurboQuantCodec(4, seed=0, block=1024)
    payload = turbo.encode(x)
    out += [
        ("turboquant encode 4bit", lambda: turbo.encode(x), x.nbytes),
        ("turboquant decode 4bit (fp32 out)", lambda: turbo.decode(payload), x.nbytes),
    ]
    out += _vote_cases(n, device)
    for b in (1, 2, 4, 8, 16):
        spec = bits.lane(b)
        codes = torch.randint(0, spec.capacity + 1, (n,), device=device).to(
            torch.uint8 if b <= 8 else torch.int32
        )
        words = bits.pack(codes, b)
        out.append((f"pack {b}bit", lambda c=codes, b=b: bits.pack(c, b, validate=False), codes.nbytes))
        out.append((f"unpack {b}bit", lambda w=words, b=b: bits.unpack(w, b, n), codes.nbytes))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 24)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N) first")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall", help="cpu: the thread's CPU time")
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1 (it counts only the calling thread)")
    clock = CLOCKS[args.clock]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    print(f"codec throughput, {args.numel:,} elements, median of {args.repeat}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} CPU threads, {args.clock} clock")
    heads = [h for d in devices for h in (f"{d.type} GB/s", f"{d.type} × clone")]
    print(f"| codec | {' | '.join(heads)} |")
    print(f"|---|{'---:|' * len(heads)}")
    table: dict[str, list[str]] = {}
    for device in devices:
        rows = cases(args.numel, device)
        rates = {name: nbytes / _time(fn, args.repeat, device, clock) / 1e9 for name, fn, nbytes in rows}
        # the yardstick once more at the end, best of both: its first timing can still pay
        # for growing the heap, which would flatter every ratio
        name, fn, nbytes = rows[0]
        rates[name] = max(rates[name], nbytes / _time(fn, args.repeat, device, clock) / 1e9)
        for name, rate in rates.items():
            table.setdefault(name, []).extend([f"{rate:.2f}", f"{rate / rates[YARDSTICK]:.2f}"])
    for name, cols in table.items():
        print(f"| {name} | {' | '.join(cols)} |")


if __name__ == "__main__":
    main()
