"""Part 4: where the time of a GPT-2-small step goes on this GPU, and the link speed above which
each algorithm stops paying.

1. **Compute**: forward + backward of GPT-2 small (:mod:`.gpt`, 124 M parameters) at 8 x 1024
   tokens under bf16 autocast (halved until it fits; ``--cpu``: a 2-layer d=128 model at 8 x
   128 in float32), median of 5 steps after 2 warm-ups (CUDA events).
2. **Codecs**: each algorithm's codec calls (:mod:`.codec_work`) on that model's real buckets:
   the planner's bucketing (``buckets.partition`` of the parameters last-first at ``LowBitConfig``'s
   default ``bucket_size_mb``), each bucket filled with the step's own gradients, timed call by
   call (median of 3 after a warm-up) and summed: encode, the server's step at P = 8 (its chunk
   from 8 gathered rows), decode. 1-bit Adam/LAMB add their optimizer step beyond AdamW's
   (``measure._optimizer_ns``, on at most 2^24 parameters in 32 tensors, per element).
   Beside each time: the torch operator calls of the step and the host time to issue them
   without a sync (:func:`.timing.op_count`, :func:`.timing.host_issue_s`), which tell a
   launch-bound codec (issue time near the measured time: needs fewer calls) from a slow kernel.
3. **Projection**: :func:`lowbit_strategy.plan.predict.predict` (the planner's own model) with
   that compute time and those codec times as nanoseconds per element of the model (each
   algorithm's measured total over its parameter count, so the planner's ``ns x N`` gives back
   the measured total), P nodes of one GPU each, at 10/25/100/400 Gbit/s and P = 8 and 64.
   Its assumptions (stated in the report): ring allreduce for DDP, α = 20 µs per message
   round, communication overlapping backward (2/3 of compute) with the last bucket exposed,
   codec time added in full (its kernels take the SMs from backward).
4. **Break-even**: per algorithm, the link speed (1-3200 Gbit/s) above which its projected
   step is slower than DDP bf16's (and than DDP fp32's): the highest speed on a log grid
   (the table's speeds included) where it is faster, refined by bisection to the next grid
   point; "pays at every speed tried" / "never pays" where so.

Failures: a measurement that raises, a non-finite loss. An algorithm that does not pay is a
finding, not a failure.
"""

from __future__ import annotations

import math
import traceback

import torch

from benchmarks.gpu_check import Part, table
from benchmarks.gpu_check import codec_work as cw
from benchmarks.gpu_check.gpt import GPT, SMALL, TINY
from benchmarks.gpu_check.timing import cpu_rank_threads, host_issue_s, median_s, op_count

LINKS = (10.0, 25.0, 100.0, 400.0)
WORLDS = (8, 64)
#: the server's gathered rows
SERVER_P = 8
#: α of the projection, µs per message round (the planner's Cluster default)
ALPHA_US = 20.0
LOW, HIGH = 1.0, 3200.0
#: algorithm -> (label, the planner's row key for world size P, codec_ns key)
ALGOS = {
    "lion": ("Lion Cub lp (default form)", lambda p: f"lion_{_lane(p)}_flat", "lp"),
    "lion_1bit": ("Lion Cub 1-bit", lambda p: "lion_1bit_flat", "1bit"),
    "onebit_adam": ("1-bit Adam", lambda p: "onebit_flat", "compensated"),
    "onebit_lamb": ("1-bit LAMB", lambda p: "onebit_lamb_flat", "compensated"),
    "bitdp": ("BitDP 2-bit", lambda p: "bitdp_flat", "bitdp"),
    "turboquant": ("TurboQuant 4-bit", lambda p: "turboquant_flat", "turboquant"),
}


def _lane(p: int) -> str:
    """Lion Cub's lane at P ranks as its default ``auto`` and the planner pick it (``lp8``...)."""
    from lowbit_strategy.algorithms.lion_cub.mode import auto_candidates
    from lowbit_strategy.config import LowBitConfig

    return auto_candidates(LowBitConfig(algorithm="lion", link_bandwidth_gbps=1, link_latency_us=0), p, 0)[0]


def _compute(model: GPT, shape: dict, dev: torch.device, batch: int) -> tuple[float, int, float, str]:
    """Median forward + backward seconds, the batch that fit, the loss, and a note."""
    cuda, note = dev.type == "cuda", ""
    while True:
        idx = torch.randint(0, shape["vocab"], (batch, shape["context"] + 1), device=dev)
        x, y = idx[:, :-1], idx[:, 1:]
        losses: list[torch.Tensor] = []

        def step(x=x, y=y, losses=losses):
            model.zero_grad(set_to_none=False)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            losses.append(loss.detach())

        try:
            seconds = median_s(step, dev, repeat=5, warmup=2)
            return seconds, batch, float(losses[-1]), note
        except torch.cuda.OutOfMemoryError:
            if batch == 1:
                raise
            note += f"batch {batch} did not fit; "
            batch //= 2
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()


def _buckets(model: GPT) -> tuple[list[list[torch.nn.Parameter]], int]:
    """The planner's buckets (parameters last-first, ``buckets.partition`` at the default size)."""
    from lowbit_strategy import buckets
    from lowbit_strategy.config import LowBitConfig

    params = [p for p in model.parameters() if p.requires_grad]
    order = list(reversed(params))
    mb = LowBitConfig().bucket_size_mb
    plan = buckets.partition([p.numel() for p in order], buckets.bucket_numel(mb))
    return [[order[i] for i in r] for r in plan], mb


def _builders(quantized: dict[int, bool], lanes: dict[str, int], cuda: bool):
    """Per codec: bucket params -> Work on the bucket's gradients (``lanes``: Lion Cub's lanes
    and the world size each is timed at). BitDP takes the bucket's
    quantized matrices only (the rest travels in float32, no codec)."""

    def flat(ps):
        return torch.cat([p.grad.detach().reshape(-1).float() for p in ps])

    def bitdp(ps):
        mats = [p.grad.detach().float().reshape(p.shape[0], -1) for p in ps if quantized[id(p)]]
        return cw.bitdp(mats, SERVER_P) if mats else cw.Work()

    out = {f"lion_{lane}": (lambda ps, b=int(lane[2:]), p=p: cw.lion_lp(flat(ps), p, b, [q.numel() for q in ps]))
           for lane, p in lanes.items()}
    out.update({
        "lion_1bit": lambda ps: cw.lion_1bit(flat(ps), SERVER_P),
        "compensated": lambda ps: cw.compensated(flat(ps), SERVER_P),
        "bitdp": bitdp,
        "turboquant": lambda ps: cw.turboquant(flat(ps), SERVER_P),
    })
    if cuda:  # auto runs the Triton kernels on CUDA: the torch backend beside them
        out["turboquant_torch"] = lambda ps: cw.turboquant(flat(ps), SERVER_P, "torch")
    return out


def _codec_times(bucket_list, builders, dev, part: Part) -> tuple[dict, dict]:
    """Seconds per step of each codec's encode / server / decode, summed over the buckets; and
    per codec the same steps' host issue ms and torch operator calls."""
    out, host = {}, {}
    for name, build in builders.items():
        print(f"   codecs: {name}", flush=True)
        sums = {"encode": 0.0, "server": 0.0, "decode": 0.0}
        issue = {"encode": 0.0, "server": 0.0, "decode": 0.0}
        ops = {"encode": 0, "server": 0, "decode": 0}
        try:
            for ps in bucket_list:
                work = build(ps)
                for step in sums:
                    fn = getattr(work, step)
                    if fn is not None:
                        sums[step] += median_s(fn, dev, repeat=3)
                        issue[step] += host_issue_s(fn)  # queued work is synchronized by the next median_s
                        ops[step] += op_count(fn)
                del work
            sums["total"] = sum(sums.values())
            out[name] = sums
            host[name] = {"issue_ms": {k: v * 1e3 for k, v in issue.items()}, "ops": ops}
        except Exception as exc:
            traceback.print_exc()
            part.failures.append(f"codec time of {name}: {type(exc).__name__}: {str(exc)[:200]}")
    return out, host


def _project(model_desc, compute_s: float, codec_ns: dict, p: int, link: float) -> dict[str, float]:
    """The planner's step seconds by row key, P nodes of one GPU each, at ``link`` Gbit/s."""
    from lowbit_strategy.pricing.nodes import Cluster
    from lowbit_strategy.config import LowBitConfig
    from lowbit_strategy.plan.inputs import Compute
    from lowbit_strategy.plan.predict import Setup, predict

    setup = Setup(model_desc, Cluster(p, 1, link, ALPHA_US), Compute(compute_s, "measured"),
                  bucket_size_mb=LowBitConfig().bucket_size_mb, codec_ns=codec_ns, codec_note="measured")
    return {r.key: r.step_s for r in predict(setup)}


def _break_even(step_at, key: str, ref: str) -> float | str:
    """The link speed above which row ``key`` stops beating row ``ref`` (module docstring)."""
    grid = sorted(set(LINKS) | {LOW * (HIGH / LOW) ** (i / 40) for i in range(41)})
    pays = [step_at(g)[key] < step_at(g)[ref] for g in grid]
    if all(pays):
        return "pays at every speed tried"
    if not any(pays):
        return "never pays"
    last = max(i for i, ok in enumerate(pays) if ok)
    lo, hi = grid[last], grid[last + 1]
    for _ in range(30):
        mid = math.sqrt(lo * hi)
        if step_at(mid)[key] < step_at(mid)[ref]:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)


def run(args) -> Part:
    """Measure and project (module docstring); one thread on a CPU, as a CPU rank runs."""
    with cpu_rank_threads(args.cpu):
        return _run(args)


def _run(args) -> Part:
    from lowbit_strategy.algorithms.bitdp.quantized_params import classify
    from lowbit_strategy.plan.inputs import from_module
    from lowbit_strategy.plan.measure import _optimizer_ns

    part = Part("time", "4. Where the time goes")
    cuda = not args.cpu and torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    shape = SMALL if cuda else TINY
    torch.manual_seed(0)
    model = GPT(**shape).to(dev)
    n = sum(p.numel() for p in model.parameters())
    print(f"   GPT {shape}: {n:,} parameters", flush=True)
    compute_s, batch, loss, note = _compute(model, shape, dev, 8)
    if not math.isfinite(loss):
        part.failures.append(f"non-finite loss {loss} in the compute timing")
    print(f"   forward + backward {compute_s * 1e3:.1f} ms at {batch} x {shape['context']}, loss {loss:.3f}",
          flush=True)
    bucket_list, mb = _buckets(model)
    desc = from_module(model, "GPT-2 small" if cuda else "tiny GPT")
    chosen = classify(model)
    quantized = {id(p): chosen[id(p)].quantized for p in model.parameters()}
    lanes = {_lane(p): p for p in WORLDS}  # Lion Cub's lane at each world size, timed at that P
    times, host = _codec_times(bucket_list, _builders(quantized, lanes, cuda), dev, part)
    try:
        steps = _optimizer_ns(dev, min(n, 1 << 24))
    except Exception as exc:
        traceback.print_exc()
        part.failures.append(f"optimizer step timing: {type(exc).__name__}: {str(exc)[:200]}")
        steps = {}
    del model
    if cuda:
        torch.cuda.empty_cache()

    def ns(p: int) -> dict[str, float]:
        keyed = {"lp": times.get(f"lion_{_lane(p)}"), "1bit": times.get("lion_1bit"),
                 "compensated": times.get("compensated"), "bitdp": times.get("bitdp"),
                 "turboquant": times.get("turboquant")}
        out = {k: v["total"] * 1e9 / n for k, v in keyed.items() if v is not None}
        return out | {k: v for k, v in steps.items()}

    rows_codec = []
    for algo, (label, _, key) in ALGOS.items():
        t = times.get(f"lion_{_lane(WORLDS[0])}" if algo == "lion" else "compensated" if key == "compensated"
                      else algo)
        extra = steps.get(f"{algo}_step", 0.0) * n * 1e-9
        if t is None:
            rows_codec.append([label, *["failed"] * 6])
            continue
        total = t["total"] + extra
        rows_codec.append([label] + [f"{t[s] * 1e3:.2f}" for s in ("encode", "server", "decode")]
                          + [f"{extra * 1e3:.2f}", f"{total * 1e3:.2f}", f"{total / compute_s:.0%}"])
    if "turboquant_torch" in times:
        t = times["turboquant_torch"]
        rows_codec.append(["TurboQuant 4-bit, torch backend (not projected)"]
                          + [f"{t[s] * 1e3:.2f}" for s in ("encode", "server", "decode")]
                          + ["0.00", f"{t['total'] * 1e3:.2f}", f"{t['total'] / compute_s:.0%}"])
    part.data = {"model": dict(shape, parameters=n, buckets=len(bucket_list), bucket_size_mb=mb, batch=batch,
                               loss=loss, forward_backward_ms=compute_s * 1e3),
                 "codec_ms": {k: {s: v * 1e3 for s, v in d.items()} for k, d in times.items()},
                 "codec_host": host, "optimizer_step_ns_per_element": steps, "projection": {}, "break_even_gbps": {}}
    rows_host = [[name] + [f"{h['ops'][s]:,} · {h['issue_ms'][s]:.2f} · {times[name][s] * 1e3:.2f}"
                           for s in ("encode", "server", "decode")] for name, h in host.items()]
    tables = []
    for p in WORLDS:
        codec_ns = ns(p)
        cache: dict[float, dict[str, float]] = {}

        def step_at(link, p=p, codec_ns=codec_ns, cache=cache):
            if link not in cache:
                cache[link] = _project(desc, compute_s, codec_ns, p, link)
            return cache[link]

        proj, rows = {}, []
        for name, key in [("DDP fp32", "ddp_fp32"), ("DDP bf16", "ddp_bf16")] + [
                (label, row(p)) for label, row, _ in ALGOS.values()]:
            cells, figures = [], {}
            for link in LINKS:
                s = step_at(link)
                fig = {"step_ms": s[key] * 1e3, "x_bf16": s["ddp_bf16"] / s[key], "x_fp32": s["ddp_fp32"] / s[key]}
                figures[str(link)] = fig
                cells.append(f"{fig['step_ms']:.1f} · {fig['x_bf16']:.2f}x · {fig['x_fp32']:.2f}x")
            proj[key] = figures
            rows.append([name if key.startswith("ddp") else f"{name} (`{key}`)"] + cells)
        part.data["projection"][str(p)] = proj
        tables.append(f"\n**P = {p}** (one GPU per node; cells: step ms · x DDP bf16 · x DDP fp32, above 1x = "
                      "faster than that DDP)\n\n" + table(["algorithm"] + [f"{g:g} Gbit/s" for g in LINKS], rows))
        for algo, (_, row, _) in ALGOS.items():
            for ref in ("ddp_bf16", "ddp_fp32"):
                try:
                    be = _break_even(step_at, row(p), ref)
                except Exception as exc:
                    traceback.print_exc()
                    part.failures.append(f"break-even of {algo} at P={p}: {type(exc).__name__}: {exc}")
                    be = "failed"
                part.data["break_even_gbps"].setdefault(algo, {})[f"{p}/{ref}"] = be
    be_rows = []
    for algo, (label, _, _) in ALGOS.items():
        got = part.data["break_even_gbps"].get(algo, {})
        be_rows.append([label] + [_show(got.get(f"{p}/{ref}")) for p in WORLDS for ref in ("ddp_bf16", "ddp_fp32")])
    part.markdown = "\n".join([
        f"{desc.source}, {len(bucket_list)} buckets of at most {mb:g} MiB (the planner's bucketing), on "
        f"{'this GPU' if cuda else 'CPU, one thread (--cpu: a tiny GPT, float32)'}. Forward + backward at "
        f"{batch} x {shape['context']} tokens{' under bf16 autocast' if cuda else ''}: **{compute_s * 1e3:.1f} ms** "
        f"(median of 5 after 2 warm-ups; loss {loss:.3f}){'; ' + note if note else ''}.",
        "", "Codec time per step, ms (real codec calls on every bucket, summed; server: its chunk from "
        f"P = {SERVER_P} gathered rows; Lion Cub at its P = {WORLDS[0]} lane {_lane(WORLDS[0])}):", "",
        table(["algorithm", "encode", "server", "decode", "optimizer beyond AdamW", "total", "of fwd+bwd"], rows_codec),
        "", "Host side of the same calls, per step (cells: torch operator calls · ms the host takes to issue "
        "them, no sync · ms measured above). Where the issue time is close to the measured time the step is "
        "bound by the host (one launch per operator), so fewer calls would make it faster and faster kernels "
        "would not. Triton kernels are not torch operators and are not counted:", "",
        table(["codec", "encode", "server", "decode"], rows_host),
        "", "TurboQuant's rows run its default backend (`auto`: the Triton kernels on CUDA, "
        "torch on a CPU); on CUDA "
        "the torch backend's time is shown beside it, not projected.",
        "", "Projected step time (`lowbit_strategy.plan.predict`, the planner's model) with the compute and codec "
        f"times above: P nodes of one GPU, ring allreduce for DDP, α = {ALPHA_US:g} µs per message round, "
        "communication overlapping backward (2/3 of compute; the last bucket's exposed), codec time added in full, "
        "optimizer step not counted (AdamW's, the same for every row; 1-bit Adam/LAMB's extra is counted). "
        f"The codec times per element are the same at P = 64 (server measured at P = {SERVER_P}); Lion Cub's lane "
        f"follows P ({', '.join(f'P={p}: {_lane(p)}' for p in WORLDS)}). TurboQuant's and BitDP's rows take the "
        "two-stage form's codec time, and the planner's per-bucket form choice (TurboQuant's `auto` may fall back to "
        "its fp32 form, where its row equals DDP fp32's).", *tables, "",
        "**Link speed above which each algorithm stops paying on this GPU** (Gbit/s, bisected on the projection "
        f"between {LOW:g} and {HIGH:g}):", "",
        table(["algorithm"] + [f"P={p} vs DDP {r}" for p in WORLDS for r in ("bf16", "fp32")], be_rows)])
    return part


def _show(value) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
