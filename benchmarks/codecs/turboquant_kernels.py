"""TurboQuant codec throughput: fused Triton kernels against the torch backend.

Times ``encode``, ``decode`` and the round trip (``decode(encode(x))``) of one tensor
(default 16M float32 elements, 4 bits, blocks of 1024, RMS scales) with

* ``torch``: the torch backend, the *unfused* baseline (one kernel per step: sign
  multiply, ten butterfly passes, RMS tree, divide, one compare per midpoint, pack; and
  back);
* ``triton``: the fused kernels (one pass over memory each way), on CUDA only;
* ``clone``: ``x.clone()``, a memory-bound yardstick (one read and one write of ``x``).

Timings: CUDA events (CPU: ``perf_counter``), a warm-up, then the median of ``--repeat``
runs. GB/s counts the bytes each step must move at least: encode reads the input and the
sign bits and writes the codes and scales; decode reads those and writes the output; the
round trip is both. On a GPU whose name is known the table also shows that as a fraction
of the device's peak memory bandwidth (H100 SXM 3.35 TB/s, H100 PCIe 2.0 TB/s, H200
4.8 TB/s, ...; ``--peak-gbs`` for another). The triton rows are checked bit-exact against
the torch rows before timing.

Without a GPU it runs the torch backend on the CPU only (default 1M elements) and says so.
Not a test: figures depend on the machine.

    python -m benchmarks.codecs.turboquant_kernels [--numel N] [--bits 4] [--block 1024]
        [--dtype float32] [--repeat 20] [--device cuda|cpu] [--peak-gbs G]
"""
from __future__ import annotations

import argparse

import torch

from lowbit_strategy.codecs import TurboQuantCodec

#: (substrings of the device name, all must match, lower case) → peak HBM/GDDR GB/s
PEAK_GBS = (
    (("h100", "pcie"), 2000.0, "H100 PCIe"),
    (("h100", "nvl"), 3900.0, "H100 NVL"),
    (("h100",), 3350.0, "H100 SXM"),
    (("h200",), 4800.0, "H200"),
    (("b200",), 8000.0, "B200"),
    (("a100", "80gb", "pcie"), 1935.0, "A100 80GB PCIe"),
    (("a100", "80gb"), 2039.0, "A100 80GB SXM"),
    (("a100",), 1555.0, "A100 40GB"),
    (("l40s",), 864.0, "L40S"),
    (("rtx 5000 ada",), 576.0, "RTX 5000 Ada"),
    (("rtx 5000",), 448.0, "Quadro RTX 5000"),
)


def device_peak(name: str) -> tuple[float | None, str]:
    """Peak memory bandwidth (GB/s) and the entry it came from, for a CUDA device name."""
    low = name.lower()
    if "gh200" in low:
        return 4000.0, "GH200 (HBM3)"
    for keys, gbs, label in PEAK_GBS:
        if all(k in low for k in keys):
            return gbs, label
    return None, "unknown device: pass --peak-gbs"


def _timer(device: torch.device, repeat: int):
    """``fn -> median seconds`` after 3 warm-up calls (:func:`benchmarks.gpu_check.timing.median_s`)."""
    from benchmarks.gpu_check.timing import median_s

    return lambda fn: median_s(fn, device, repeat, warmup=3)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--numel", type=int, default=None, help="elements (default 16M on CUDA, 1M on CPU)")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--block", type=int, default=1024)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs (median)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    parser.add_argument("--peak-gbs", type=float, default=None, help="peak memory bandwidth, GB/s")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    n = args.numel or ((1 << 24) if device.type == "cuda" else (1 << 20))
    dtype = getattr(torch, args.dtype)
    x = torch.randn(n, device=device).to(dtype)

    backends = ["torch"]
    peak, peak_label = args.peak_gbs, "--peak-gbs" if args.peak_gbs else "-"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if peak is None:
            peak, peak_label = device_peak(name)
        print(f"device: {name}; peak memory bandwidth: "
              + (f"{peak:.0f} GB/s ({peak_label})" if peak else peak_label))
        from lowbit_strategy.codecs import turboquant_triton as tt

        if tt.AVAILABLE and not tt.INTERPRETED:
            backends.append("triton")
        else:
            print("triton: not available (pip install \"lowbit-strategy[triton]\"; unset TRITON_INTERPRET)")
    else:
        print(f"device: CPU ({torch.get_num_threads()} threads) -- no GPU here: torch backend only, "
              "no Triton rows (the fused kernels need CUDA)")
    print(f"x: {n} x {args.dtype}, bits={args.bits}, block={args.block}, RMS scales, {args.repeat} runs (median)")

    codecs = {b: TurboQuantCodec(bits=args.bits, block=args.block, backend=b) for b in backends}
    p_ref = codecs["torch"].encode(x)
    if "triton" in codecs:
        p = codecs["triton"].encode(x)
        exact = (torch.equal(p.codes, p_ref.codes) and _same_bits(p.scales, p_ref.scales)
                 and _same_bits(codecs["triton"].decode(p_ref), codecs["torch"].decode(p_ref)))
        print(f"triton bit-exact against torch: {'yes' if exact else 'NO'}")

    in_bytes = n * x.element_size()
    sign_bytes = -(-n // 8)
    payload_bytes = p_ref.nbytes
    moved = {
        "encode": in_bytes + sign_bytes + payload_bytes,
        "decode": payload_bytes + sign_bytes + in_bytes,
    }
    moved["round trip"] = moved["encode"] + moved["decode"]

    timer = _timer(device, args.repeat)
    rows = [("clone (yardstick)", "read+write x", timer(lambda: x.clone()), 2 * in_bytes)]
    for b, codec in codecs.items():
        p = codec.encode(x)
        rows.append((b, "encode", timer(lambda c=codec: c.encode(x)), moved["encode"]))
        rows.append((b, "decode", timer(lambda c=codec, p=p: c.decode(p)), moved["decode"]))
        rows.append((b, "round trip", timer(lambda c=codec: c.decode(c.encode(x))), moved["round trip"]))

    head = f"{'backend':<18} {'step':<13} {'time (ms)':>10} {'GB/s':>9} {'of peak':>8}"
    print(head)
    print("-" * len(head))
    for backend, step, secs, nbytes in rows:
        gbs = nbytes / secs / 1e9
        frac = f"{gbs / peak:7.1%}" if peak else "      -"
        print(f"{backend:<18} {step:<13} {secs * 1e3:>10.3f} {gbs:>9.2f} {frac:>8}")
    if "triton" in codecs:
        t = {(r[0], r[1]): r[2] for r in rows}
        print(f"round trip: triton {t['triton', 'round trip'] * 1e3:.3f} ms vs torch (unfused) "
              f"{t['torch', 'round trip'] * 1e3:.3f} ms: {t['torch', 'round trip'] / t['triton', 'round trip']:.1f}x "
              "(paper, RTX 5000: 26.2 ms fused vs 73.5 ms unfused for 16M)")


if __name__ == "__main__":
    main()
