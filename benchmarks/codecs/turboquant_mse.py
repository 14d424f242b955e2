"""Quantization error and CPU throughput of the TurboQuant codec (torch backend).

Prints two markdown tables:

1. Relative MSE (``mean((x̂ - x)²) / var(x)``) of 4-bit codes for a Gaussian and a
   Student-t (df = 3, heavy-tailed) input of ``--numel`` elements: Lloyd–Max levels with
   and without the Hadamard rotation (``TurboQuantCodec``, RMS scale per block), and the
   uniform 4-bit quantizer (16 evenly spaced levels over ``[-max|x|, max|x|]``) with and
   without the rotation, once with one range for the whole tensor and once per block
   (the same granularity as the codec's scales). The last columns put the reduction of
   TurboQuant against uniform next to the 82 % claimed by "TurboQuant-Adam" (measured
   there on GPT-2 gradient tensors, not on these synthetic inputs).
2. encode / decode GB/s (float32 input bytes per second, median of ``--repeat``) next to
   ``torch.clone`` of the same input, on this CPU with ``--threads`` threads (default 1).

Not a test: figures depend on the machine and the draw.

    python -m benchmarks.codecs.turboquant_mse [--numel 1048576] [--repeat 5] [--threads 1] [--block 1024]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lowbit_strategy.codecs import TurboQuantCodec, hadamard_rotate, hadamard_unrotate

PAPER_REDUCTION = 0.82


def rel_mse(xhat: torch.Tensor, x: torch.Tensor) -> float:
    x = x.double()
    return ((xhat.double() - x) ** 2).mean().item() / x.var().item()


def uniform4(x: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """16 evenly spaced levels over [-max|x|, max|x|] (per ``block`` elements if given)."""
    if block is None:
        m = x.abs().max()
        step = 2 * m / 15
        return torch.round((x + m) / step).clamp(0, 15) * step - m
    n = x.numel()
    pad = -n % block
    v = torch.cat([x, x.new_zeros(pad)]).view(-1, block)
    m = v.abs().amax(dim=1, keepdim=True)
    step = torch.where(m > 0, 2 * m / 15, torch.ones_like(m))
    out = torch.round((v + m) / step).clamp(0, 15) * step - m
    return out.view(-1)[:n]


def student_t(n: int, gen: torch.Generator) -> torch.Tensor:
    z = torch.randn(n, generator=gen, dtype=torch.float64)
    chi2 = (torch.randn(3, n, generator=gen, dtype=torch.float64) ** 2).sum(0)
    return (z / torch.sqrt(chi2 / 3)).float()


def mse_table(n: int, block: int) -> str:
    gen = torch.Generator().manual_seed(0)
    inputs = {"Gaussian": torch.randn(n, generator=gen), "Student-t (df 3)": student_t(n, gen)}
    tq, tq_plain = TurboQuantCodec(bits=4, block=block), TurboQuantCodec(bits=4, block=block, rotate=False)
    rows = [
        "| input | Lloyd–Max + rotation (TurboQuant) | Lloyd–Max, no rotation | uniform + rotation "
        "| uniform, no rotation | uniform/block + rotation | uniform/block, no rotation "
        "| TurboQuant MSE reduction vs uniform: tensor range + rotation / tensor range / block range + rotation / block range | paper's claim |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, x in inputs.items():
        y = hadamard_rotate(x, 0, block)
        m = {
            "tq": rel_mse(tq.roundtrip(x), x),
            "lm": rel_mse(tq_plain.roundtrip(x), x),
            "u_rot": rel_mse(hadamard_unrotate(uniform4(y), 0, block), x),
            "u": rel_mse(uniform4(x), x),
            "ub_rot": rel_mse(hadamard_unrotate(uniform4(y, block), 0, block), x),
            "ub": rel_mse(uniform4(x, block), x),
        }
        red = " / ".join(
            f"{1 - m['tq'] / m[k]:.1%}" for k in ("u_rot", "u", "ub_rot", "ub")
        )
        rows.append(
            f"| {name} | {m['tq']:.5f} | {m['lm']:.5f} | {m['u_rot']:.5f} | {m['u']:.5f} "
            f"| {m['ub_rot']:.5f} | {m['ub']:.5f} | {red} | {PAPER_REDUCTION:.0%} |"
        )
    return "\n".join(rows)


def _time(fn, repeat: int) -> float:
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def speed_table(n: int, block: int, repeat: int) -> str:
    x = torch.randn(n)
    nbytes = x.numel() * 4
    rows = ["| operation | GB/s (fp32 input bytes) | × clone |", "|---|---|---|"]
    clone = nbytes / _time(lambda: x.clone(), repeat) / 1e9
    rows.append(f"| torch.clone (memory-bound yardstick) | {clone:.2f} | 1.00 |")
    for bits in (2, 4):
        codec = TurboQuantCodec(bits=bits, block=block)
        payload = codec.encode(x)
        for label, fn in (
            (f"encode, {bits} bits", lambda c=codec: c.encode(x)),
            (f"decode, {bits} bits", lambda c=codec, p=payload: c.decode(p)),
        ):
            gbs = nbytes / _time(fn, repeat) / 1e9
            rows.append(f"| {label} | {gbs:.3f} | {gbs / clone:.3f} |")
    gbs = nbytes / _time(lambda: hadamard_rotate(x, 0, block), repeat) / 1e9
    rows.append(f"| hadamard_rotate alone (signs drawn per call) | {gbs:.3f} | {gbs / clone:.3f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1 << 20)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--block", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"## Relative MSE at 4 bits (n = {args.numel}, block = {args.block})\n")
    print(mse_table(args.numel, args.block))
    print(f"\n## Throughput, CPU, {args.threads} thread(s), n = {args.numel}\n")
    print(speed_table(args.numel, args.block, args.repeat))


if __name__ == "__main__":
    main()
