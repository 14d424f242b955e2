"""Throughput of each codec on this machine (CPU, and CUDA when one is present).

Prints a table of GB/s, counting the bytes of the float32 input (or of the codes, for
pack/unpack) processed per second; the median of several timed repetitions after a
warm-up. Not a test: figures depend on the machine.

    python -m benchmarks.codecs [--numel 16777216] [--repeat 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lowbit_strategy.codecs import bits, channel_encode, lp_quantize, sign_bits


def _time(fn, repeat: int, device: torch.device) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def cases(n: int, device: torch.device):
    """(name, callable, bytes processed) for every codec."""
    x = torch.randn(n, device=device)
    rows = x.view(-1, 1024)
    out = [
        ("sign_bits", lambda: sign_bits(x, 1), x.nbytes),
        ("lp_quantize p=1 8bit", lambda: lp_quantize(x, 8, 1), x.nbytes),
        ("lp_quantize p=0 8bit", lambda: lp_quantize(x, 8, 0), x.nbytes),
        ("lp_quantize p=inf 8bit", lambda: lp_quantize(x, 8, float("inf")), x.nbytes),
        ("channel_encode 1bit", lambda: channel_encode(rows, 1), x.nbytes),
        ("channel_encode 2bit", lambda: channel_encode(rows, 2), x.nbytes),
    ]
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
    args = parser.parse_args()
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    print(f"codec throughput, {args.numel:,} elements, median of {args.repeat}; torch {torch.__version__}, "
          f"{torch.get_num_threads()} CPU threads")
    print(f"| codec | {' | '.join(f'{d.type} GB/s' for d in devices)} |")
    print(f"|---|{'---|' * len(devices)}")
    table: dict[str, list[str]] = {}
    for device in devices:
        for name, fn, nbytes in cases(args.numel, device):
            seconds = _time(fn, args.repeat, device)
            table.setdefault(name, []).append(f"{nbytes / seconds / 1e9:.2f}")
    for name, cols in table.items():
        print(f"| {name} | {' | '.join(cols)} |")


if __name__ == "__main__":
    main()
