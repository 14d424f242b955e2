"""Part 2: every codec's encode and decode on this GPU, eager and compiled, against a copy.

For each codec of :mod:`.codec_work` (the calls the collectives make, with their arguments)
at 2^24 and 2^26 float32 elements (``--cpu``: 2^16 and 2^18): median seconds over 5 calls
after a warm-up (CUDA events), as GB/s and as a multiple of a device-to-device copy of the
same float32 vector. **GB/s counts the float32 vector's 4·n bytes** (read by an encode,
written by a decode, the gathered rows' n elements for a server step), whatever the codec
actually touches; the copy's GB/s counts the same 4·n bytes (it reads them and writes them),
so "x copy" is the copy's time over the codec's. An eager speed below 25 % of a copy is
flagged. Server steps run on P = 4 gathered rows of n/4 elements each (a bucket of n over
4 ranks).

"Compiled" is reported twice, honestly:

* ``compile_codecs`` (:mod:`lowbit_strategy.codecs.compiled`, the project's opt-in chains of
  the elementwise work): each encode with it on, compared bit for bit with eager (a
  difference is a failure: the chains promise eager's bits) and timed at the smaller size;
  "not covered" where no chain serves that encode;
* ``torch.compile`` of a codec's encode function itself (``dynamic=False``, at the smaller
  size, not part of the project and so "not bit-checked" by its tests): compared bit for bit
  with the eager output here and timed, for a few codecs, within a compile budget
  (:data:`COMPILE_BUDGET_S`; one that fails to compile is a note, not a failure).

TurboQuant runs with the torch backend and the Triton backend (CUDA only), whose codes
must equal the torch backend's bit for bit (a failure otherwise). On CUDA (not ``--cpu``)
the part also writes the planner's codec timings (:data:`~benchmarks.gpu_check.CODECS_JSON`,
:func:`lowbit_strategy.plan.measure.measure_codecs`). ``data["ns_per_element"]`` has each
codec's eager encode/decode/server nanoseconds per element at the larger size.
"""

from __future__ import annotations

import math
import time
import traceback

import torch

from benchmarks.gpu_check import CODECS_JSON, ROOT, Part, table, write_codecs
from benchmarks.gpu_check import codec_work as cw
from benchmarks.gpu_check.timing import copy_s, cpu_rank_threads, median_s

#: seconds of torch.compile this part may spend; no new compile starts past it
COMPILE_BUDGET_S = 75.0
#: server steps gather this many rows
SERVER_ROWS = 4
#: eager speeds below this fraction of a copy are flagged
SLOW = 0.25


def _codecs(cuda: bool):
    """(name, builder(x) -> Work, compile its encode?) in report order."""
    p = SERVER_ROWS
    rows = [
        ("Lion Cub lp8 codes", lambda x: cw.lion_lp(x, p, 8), True),
        ("Lion Cub 1-bit signs / vote count", lambda x: cw.lion_1bit(x, p), True),
        ("1-bit Adam/LAMB scaled signs", lambda x: cw.compensated(x, p), True),
        ("BitDP 2-bit channel codes (two-stage)", lambda x: cw.bitdp([x.view(-1, 1024)], p), True),
        ("TurboQuant 4-bit, torch backend", lambda x: cw.turboquant_plain(x, "torch"), True),
        ("TurboQuant two-stage (P chunks), torch", lambda x: cw.turboquant(x, p, "torch"), False),
    ]
    if cuda:
        rows += [
            ("TurboQuant 4-bit, Triton backend", lambda x: cw.turboquant_plain(x, "triton"), False),
            ("TurboQuant two-stage (P chunks), Triton", lambda x: cw.turboquant(x, p, "triton"), False),
        ]
    rows += [(f"blockwise int{b} (FSDP reduce-scatter)", lambda x, b=b: cw.blockwise(x, b), b == 4) for b in (8, 4, 2)]
    rows.append(("DeMo top-32 1-bit (DCT, top-k; mean of P)", lambda x: cw.demo(x, p), False))
    rows.append(("rank_sum of gathered float32 rows", lambda x: cw.rank_sum(x, p), False))
    return rows


def _fmt(seconds: float | None, n: int, copy: float) -> tuple[str, dict]:
    if seconds is None:
        return "-", {}
    gbps = 4 * n / seconds / 1e9
    ratio = copy / seconds
    flag = " ⚠" if ratio < SLOW else ""
    return f"{seconds * 1e3:.3f} ms · {gbps:.1f} GB/s · {ratio:.2f}x{flag}", {
        "ms": seconds * 1e3, "gbps": gbps, "x_copy": ratio}


def _cell(note: str, fig: dict, copy: float) -> tuple[str, dict]:
    """A compiled column's cell: the note, or the time, × copy, the bit check and the compile time."""
    if fig.get("ms"):
        ok = "bit-equal to eager" if fig["bit_equal"] else "**differs from eager**"
        note = f"{fig['ms']:.3f} ms · {copy * 1e3 / fig['ms']:.2f}x copy · {ok} · compiled in {fig['compile_s']:.0f} s"
    return note, fig


def _compile_codecs(name, build, x, dev) -> tuple[str, dict]:
    """``build(x).encode`` with ``compile_codecs`` on: which chains served it, its bits against
    eager, its time (module docstring)."""
    from lowbit_strategy.codecs import compiled

    eager = build(x).encode()
    served: list[str] = []
    run = compiled._run
    compiled._run = lambda chain, *a: (served.append(chain), run(chain, *a))[1]
    compiled.use_compiled(True)
    try:
        start = time.perf_counter()
        work = build(x)
        first = work.encode()  # compiles the chains it needs (once per process)
        seconds_compile = time.perf_counter() - start
        if not served:
            return "not covered", {"covered": False}
        failed = sorted(set(served) & compiled._failed)
        if failed:
            return f"chains failed to compile: {', '.join(failed)} (eager ran)", {"failed": failed}
        same = cw.bit_equal(eager, first)
        seconds = median_s(work.encode, dev)
    except Exception as exc:
        print(f"   compile_codecs on {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return f"failed ({type(exc).__name__})", {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    finally:
        compiled.use_compiled(False)
        compiled._run = run
    return "", {"ms": seconds * 1e3, "bit_equal": same, "compile_s": seconds_compile,
                "chains": sorted(set(served))}


def _compiled(name, build, x, dev, budget) -> tuple[str, dict]:
    """torch.compile of ``build(x).encode``: bit check against eager, then timed."""
    if budget["left"] <= 0:
        return "skipped (compile budget spent)", {"skipped": "budget"}
    start = time.perf_counter()
    try:
        eager = build(x).encode()  # a fresh Work: the same state the compiled one starts from
        fn = torch.compile(build(x).encode, dynamic=False)
        first = fn()
        seconds_compile = time.perf_counter() - start
        same = cw.bit_equal(eager, first)
        seconds = median_s(fn, dev)
    except Exception as exc:  # a codec torch.compile cannot take is a note, not a failure
        budget["left"] -= time.perf_counter() - start
        print(f"   torch.compile of {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return f"did not compile ({type(exc).__name__})", {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    budget["left"] -= time.perf_counter() - start
    return "", {"ms": seconds * 1e3, "bit_equal": same, "compile_s": seconds_compile}


def run(args) -> Part:
    """Time every codec (module docstring). On a CPU with one thread, as a CPU rank runs (more
    threads on a busy machine spin and time 10-300x slower, :mod:`lowbit_strategy.plan.measure`)."""
    with cpu_rank_threads(args.cpu):
        return _run(args)


def _run(args) -> Part:
    part = Part("codecs", "2. Codec speed on this GPU")
    cuda = not args.cpu and torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    sizes = (1 << 24, 1 << 26) if cuda else (1 << 16, 1 << 18)
    budget = {"left": COMPILE_BUDGET_S if cuda else 0.0}
    copies = {n: copy_s(n, dev) for n in sizes}
    data: dict = {"device": str(dev), "sizes": list(sizes), "server_rows": SERVER_ROWS,
                  "copy_ms": {str(n): copies[n] * 1e3 for n in sizes}, "codecs": {}, "ns_per_element": {}}
    head = ["codec", "step"] + [f"eager 2^{int(math.log2(n))}" for n in sizes]
    head += [f"compile_codecs 2^{int(math.log2(sizes[0]))}", f"torch.compile 2^{int(math.log2(sizes[0]))} (not bit-checked)"]
    rows, slow = [], []
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, build, compile_it in _codecs(cuda):
        print(f"   {name}", flush=True)
        entry: dict = {}
        try:
            per_size = {}
            for n in sizes:
                x = torch.randn(n, device=dev, generator=gen)
                work = build(x)
                per_size[n] = {step: median_s(fn, dev) for step in ("encode", "decode", "server")
                               if (fn := getattr(work, step)) is not None}
                del work
            comp, chains = {}, {}
            if cuda and compile_it:
                x = torch.randn(sizes[0], device=dev, generator=gen)
                chains = _compile_codecs(name, build, x, dev)
                comp = _compiled(name, build, x, dev, budget)
                if chains[1].get("bit_equal") is False:
                    part.failures.append(f"{name}: compile_codecs' chains differ from eager on this GPU")
            for step in per_size[sizes[0]]:
                cells, figures = [], {}
                for n in sizes:
                    text, fig = _fmt(per_size[n].get(step), n, copies[n])
                    cells.append(text)
                    figures[str(n)] = fig
                    if fig and fig["x_copy"] < SLOW and n == sizes[-1]:
                        slow.append(f"{name} {step}")
                cc = c = "not run on CPU (--cpu)" if not cuda else "-"
                if chains and step == "encode":
                    cc, figures["compile_codecs"] = _cell(*chains, copies[sizes[0]])
                if comp and step == "encode":
                    c, figures["torch_compile"] = _cell(*comp, copies[sizes[0]])
                rows.append([name, step] + cells + [cc, c])
                entry[step] = figures
                data["ns_per_element"][f"{name}/{step}"] = per_size[sizes[-1]][step] * 1e9 / sizes[-1]
            if name.startswith("TurboQuant 4-bit, Triton"):
                x = torch.randn(sizes[0], device=dev, generator=gen)
                same = cw.bit_equal(cw.turboquant_plain(x, "triton").encode(), cw.turboquant_plain(x, "torch").encode())
                entry["triton_equals_torch"] = same
                if not same:
                    part.failures.append("TurboQuant: the Triton backend's codes differ from the torch backend's")
        except Exception as exc:  # one codec's failure is a line; the others still run
            traceback.print_exc()
            part.failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:200]}")
            rows.append([name, "FAILED", *["-"] * len(sizes), "-", f"{type(exc).__name__}"])
        data["codecs"][name] = entry
        if cuda:
            torch.cuda.empty_cache()
    part.data = data
    lines = [f"Median of 5 calls after a warm-up ({'CUDA events' if cuda else 'wall clock, CPU'}). Cells: time · "
             "GB/s of the float32 vector's 4·n bytes (read by encode, written by decode, the gathered rows' n for a "
             f"server step) · x a device-to-device copy of those 4·n bytes (copy: "
             + ", ".join(f"{copies[n] * 1e3:.3f} ms at 2^{int(math.log2(n))}" for n in sizes)
             + f"). ⚠: below {SLOW:.0%} of a copy. Server steps: P = {SERVER_ROWS} gathered rows of n/{SERVER_ROWS}.",
             "", table(head, rows), ""]
    lines.append("`compile_codecs` (`LowBitConfig.compile_codecs`, `codecs.compiled.use_compiled`): the encode with "
                 "the project's compiled elementwise chains, checked bit for bit against eager (a difference fails "
                 "the part); \"not covered\" where no chain serves that encode." if cuda else
                 "--cpu: the Triton rows and the compiled columns need CUDA and are not run; `compile_codecs` "
                 "(CPU inductor chains, 13 s+ to compile cold) is left out to keep this part to seconds.")
    if slow:
        lines.append(f"\nBelow {SLOW:.0%} of a copy at the larger size: " + ", ".join(slow) + ".")
    if cuda:
        lines.append(_planner_codecs(part))
    part.markdown = "\n".join(lines)
    return part


def _planner_codecs(part: Part) -> str:
    """``lowbit-plan``'s codec timings on this GPU, written to :data:`CODECS_JSON`."""
    from lowbit_strategy.plan.measure import measure_codecs

    try:
        ns, device = measure_codecs("cuda")
    except Exception as exc:
        traceback.print_exc()
        part.failures.append(f"measure_codecs('cuda'): {type(exc).__name__}: {str(exc)[:200]}")
        return ""
    write_codecs(ns, device)
    part.data["planner_ns_per_element"] = ns
    return (f"\nWrote `{CODECS_JSON.relative_to(ROOT)}` (`measure_codecs('cuda')`, ns per element): "
            + ", ".join(f"{k} {v:.3g}" for k, v in sorted(ns.items())))
