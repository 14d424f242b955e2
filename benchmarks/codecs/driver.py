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

``--compiled`` adds the compiled codec chains (``LowBitConfig.compile_codecs``,
:mod:`lowbit_strategy.codecs.compiled`) on the CPU: each dispatched codec's first call
compiles it (its seconds are printed in a table of their own, cold or from inductor's
cache), then it is timed like the eager one; the table shows both side by side (codecs
without a compiled chain show ``–``).

    python -m benchmarks.codecs [--numel 16777216] [--repeat 5] [--threads N] [--clock cpu] [--compiled]
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
    compiled,
    lp_quantize,
    majority_bits,
    scaled_sign_compress,
    scaled_sign_decode,
    sign_bits,
    sign_bits_packed,
    signs_from_bits,
)

YARDSTICK = "torch.clone (memory-bound yardstick)"

#: the rows whose codec dispatches to a compiled chain under ``--compiled``
COMPILED_ROWS = (
    "lp_quantize p=1 8bit",
    "lp_quantize p=0 8bit",
    "lp_quantize p=inf 8bit",
    "channel_encode 2bit",
    "scaled_sign_compress",
)


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def median_seconds(fn, repeat: int, device: torch.device, clock=time.perf_counter) -> float:
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
        codes = torch.randint(0, spec.capacity + 1, (n,), device=device).to(torch.uint8 if b <= 8 else torch.int32)
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
    parser.add_argument("--compiled", action="store_true", help="also time the compiled codec chains (CPU)")
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        parser.error("--clock cpu needs --threads 1 (it counts only the calling thread)")
    clock = CLOCKS[args.clock]
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    print(
        f"codec throughput, {args.numel:,} elements, median of {args.repeat}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads, {args.clock} clock"
    )
    heads = [h for d in devices for h in (f"{d.type} GB/s", f"{d.type} × clone")]
    if args.compiled:
        heads += ["compiled cpu GB/s", "compiled × clone", "eager × clone, same rounds"]
    print(f"| codec | {' | '.join(heads)} |")
    print(f"|---|{'---:|' * len(heads)}")
    table: dict[str, list[str]] = {}
    for device in devices:
        rows = cases(args.numel, device)
        rates = {name: nbytes / median_seconds(fn, args.repeat, device, clock) / 1e9 for name, fn, nbytes in rows}
        # the yardstick once more at the end, best of both: its first timing can still pay
        # for growing the heap, which would flatter every ratio
        name, fn, nbytes = rows[0]
        rates[name] = max(rates[name], nbytes / median_seconds(fn, args.repeat, device, clock) / 1e9)
        for name, rate in rates.items():
            table.setdefault(name, []).extend([f"{rate:.2f}", f"{rate / rates[YARDSTICK]:.2f}"])
    if args.compiled:
        compile_seconds = _compiled_columns(args, clock, table)
    for name, cols in table.items():
        print(f"| {name} | {' | '.join(cols)} |")
    if args.compiled:
        print("\ncompile seconds (first call of each compiled codec, compilation included)")
        print("| codec | seconds |\n|---|---:|")
        for name, seconds in compile_seconds.items():
            print(f"| {name} | {seconds:.1f} |")


def _compiled_columns(args, clock, table: dict[str, list[str]]) -> dict[str, float]:
    """Time the compiled chains on the CPU and add their columns to ``table``; returns each
    codec's first-call seconds (wall clock: the compilation, or its load from inductor's cache).

    Interleaved, because the yardstick itself moves by ±20 % between phases on a shared
    machine: for each compiled codec, ``--repeat`` rounds of clone, eager codec, compiled
    codec back to back; the medians give the compiled GB/s and both codecs' GB/s over the same
    rounds as fractions of the clone. The clone counted is the fastest of its isolated
    timing (the first table) and these rounds: between codecs it runs slower (its fresh
    buffer faults in again), which would flatter the fractions."""
    device = torch.device("cpu")
    rows = cases(args.numel, device)  # their inputs (TurboQuant's payload) made by the eager codecs
    seconds: dict[str, float] = {}
    compiled.use_compiled(True)
    for name, fn, _ in rows:
        if name in COMPILED_ROWS:
            start = time.perf_counter()
            fn()
            seconds[name] = time.perf_counter() - start
    clone = rows[0][1]
    rates: dict[str, dict[bool | None, float]] = {}
    clone_times: list[float] = []
    for name, fn, nbytes in rows:
        if name not in COMPILED_ROWS:
            continue
        samples: dict[bool | None, list[float]] = {None: [], False: [], True: []}
        for flag in (None, False, True, None, False, True):  # warm-up
            compiled.use_compiled(bool(flag))
            (clone if flag is None else fn)()
        for _ in range(args.repeat):
            for flag in (None, False, True):
                compiled.use_compiled(bool(flag))
                start = clock()
                (clone if flag is None else fn)()
                samples[flag].append(clock() - start)
        clone_times += samples[None]
        rates[name] = {flag: nbytes / statistics.median(t) / 1e9 for flag, t in samples.items()}
    compiled.use_compiled(False)
    best = max(float(table[YARDSTICK][0]), rows[0][2] / statistics.median(clone_times) / 1e9)
    cols = {YARDSTICK: [f"{best:.2f}", "1.00", "1.00"]}
    for name, rate in rates.items():
        cols[name] = [f"{rate[True]:.2f}", f"{rate[True] / best:.2f}", f"{rate[False] / best:.2f}"]
    for name, row in table.items():
        row.extend(cols.get(name, ["–", "–", "–"]))
    return seconds


if __name__ == "__main__":
    main()
