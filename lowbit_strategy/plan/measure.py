"""``lowbit-plan --measure``: plan with the figures of the machines at hand, not typed ones.

Run under ``torchrun`` (or any launcher that exports ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` and ``LOCAL_WORLD_SIZE``) on the cluster itself. Every rank:

1. between nodes (N > 1): allreduces, all-to-alls and all-gathers over the cross-node groups
   (local rank j of every node), all L groups at once as the hierarchical form runs them,
   at 3 sizes each (64 KiB, 1 MiB, 16 MiB; fewer if a size would overrun the 5 s budget),
   α and β fitted by least squares (:func:`~lowbit_strategy.pricing.link_probe.
   fit_alpha_beta`); the allreduce's fit is planned for (the link's rate: gloo's all-gather
   and all-to-all are slower on the same link, reported beside it), and a node's link is L
   times what one rank's collective got;
2. inside a node (L > 1): all-gathers over the node's ranks, fitted the same way;
3. with ``--model`` and ``--inputs pkg.mod:fn`` (a batch for one GPU): forward + backward
   of the model (median of 3 after a warm-up) as the compute time.

Bounded: at most 3 probes of 4 sizes × 4 collectives each plus the compute timing; every
figure is agreed as the slowest rank's (MAX allreduce), so every rank plans alike; rank 0
prints. Codec timings: :func:`measure_codecs` (``--measure-codecs``), on this machine.

**Codecs under contention.** A CPU run of R ranks on C < R cores (the emulated cluster of
:mod:`benchmarks.nodes.driver`: 4 ranks on 2 cores) gives each rank's codec R/C of a core and a
share of the memory bandwidth. Timing the codecs on one idle thread and scaling by R/C would
assume pure time-slicing; :func:`measure_codecs` with ``processes=R`` instead runs R
one-thread processes that time the codecs at the same moment (each keeps working until the
last has finished, so no timing runs on a quieter machine), the contention the run will
have, measured, cache and memory bandwidth included. The compute time it is added to is
measured the same way (the run's own comm-free step, or ``--measure`` on every rank).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import multiprocessing as mp
import os
import statistics
import time
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist

from lowbit_strategy.collectives import group as g
from lowbit_strategy.plan.inputs import PlanError
from lowbit_strategy.pricing.calibration import median_seconds, sample_values
from lowbit_strategy.pricing.link_probe import LinkFit, probe

#: bytes per peer of the measured collectives (3 sizes)
SIZES = (64 << 10, 1 << 20, 16 << 20)
#: seconds each probe may take
BUDGET_S = 5.0
#: elements of the sample each codec is timed on (a CPU)
CODEC_SAMPLE = 1 << 20
#: ... on a GPU: 2^20 elements in 32 tensors leave a GPU launch-bound (the H100's first report
#: priced 1-bit Adam's extra optimizer pass at 2.7 ns per element, ~16x what the same pass
#: took on a 124M-parameter model's buckets), so GPUs time 2^24
GPU_CODEC_SAMPLE = 1 << 24
#: tensors the sample is split into for the optimizer steps (the per-tensor work counts too)
OPTIMIZER_TENSORS = 32
#: optimizer-step keys of :func:`measure_codecs`: the step's time beyond AdamW's, per element
OPTIMIZER_STEPS = ("onebit_adam_step", "onebit_lamb_step")


def measure_codecs(
    device: torch.device | str | None = None, sample: int | None = None, processes: int = 1
) -> tuple[dict, str]:
    """Encode + decode nanoseconds per element of each codec on ``device`` (the GPU when
    there is one, else this CPU), timed on ``sample`` random values: Lion Cub's 8-bit L1
    codes (``lp``) and 1-bit votes, 1-bit Adam's scaled signs (``compensated``), TurboQuant's
    4-bit codec, BitDP's 2-bit channel codes and PowerSGD's rank-4 products; and, per
    element, the compression-stage step of 1-bit Adam and of 1-bit LAMB beyond AdamW's
    (:data:`OPTIMIZER_STEPS`: LAMB's trust ratios and the staged optimizers' extra passes,
    which a compute time measured with AdamW leaves out). ``sample``: :data:`CODEC_SAMPLE`
    on a CPU, :data:`GPU_CODEC_SAMPLE` elsewhere (None).

    ``processes`` > 1 (CPU only): that many one-thread processes time them at once, the
    contention of a run with that many ranks on this machine (module docstring); the figures
    are the mean over the processes."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if sample is None:
        sample = CODEC_SAMPLE if dev.type == "cpu" else GPU_CODEC_SAMPLE
    if dev.type == "cpu" and processes > 1:
        return _contended(sample, processes)
    if dev.type == "cpu":  # as a CPU rank runs (launchers set OMP_NUM_THREADS=1); more threads on a
        threads = torch.get_num_threads()  # busy machine measured 10-300x slower, spinning
        torch.set_num_threads(1)
        try:
            return _measure_codecs(dev, sample)
        finally:
            torch.set_num_threads(threads)
    return _measure_codecs(dev, sample)


def _measure_codecs(dev: torch.device, sample: int) -> tuple[dict, str]:
    from lowbit_strategy.algorithms.lion_cub.mode import measure_codec_seconds
    from lowbit_strategy.codecs import (
        TurboQuantCodec,
        blockwise,
        channel_decode,
        channel_encode,
        scaled_sign_compress,
        scaled_sign_decode,
    )
    from lowbit_strategy.codecs.topk import TopKCodec
    from lowbit_strategy.codecs.turboquant_rows import decode_rows, encode_rows

    sample = max(1024, sample // 1024 * 1024)  # whole TurboQuant rotation blocks
    x = sample_values(sample, device=dev)
    lion = measure_codec_seconds(("lp8", "1bit"), 2, sample, 1.0, dev, sample, 3)
    error = torch.zeros_like(x)
    turbo = TurboQuantCodec(4, seed=0, block=1024)
    rows = x.view(-1, 1024)
    m = x.view(1024, -1)
    q = sample_values(m.shape[1], 4, device=dev)

    def onebit():
        packed, scales = scaled_sign_compress(x, error)[:2]
        return scaled_sign_decode(packed, scales, sample)

    def bitdp():
        codes, scales = channel_encode(rows, 2, validate=False)
        return channel_decode(codes, scales, 2)

    def blockwise_int4():  # the quantized reduce-scatter's codec (fsdp_reduce_scatter='int4')
        codes, scales = blockwise.encode(rows_x, 4)
        return blockwise.decode(codes, scales, 4, sample)

    def powersgd():
        p = torch.linalg.qr(m @ q).Q
        return p @ (m.T @ p).T

    rows_x = x.view(1, -1)
    codes, tq_scales = encode_rows(turbo, rows_x)
    dm = x.view(-1, 1024)  # 64 x 64 chunks (the sample holds whole 64-row blocks)
    demo_codec = TopKCodec([tuple(dm.shape)], 64, 32, "sign", dev)

    def demo():  # DeMo's step: encode (transform, top-k, pack, the sent part back) and two workers' mean
        payload = demo_codec.encode([dm])[0]
        return demo_codec.mean(torch.stack([payload, payload]), [dm])

    y = sample_values(*x.shape, device=dev)
    timed = {
        "compensated": onebit,
        "turboquant": lambda: turbo.decode(turbo.encode(x)),
        # TurboQuant's forms per element (predict.turboquant_codec_ns counts them as the
        # algorithm's own plan does): one encode, one decode, one float32 add
        "turboquant_encode": lambda: encode_rows(turbo, rows_x),
        "turboquant_decode": lambda: decode_rows(turbo, codes, tq_scales, sample),
        "add": lambda: torch.add(x, y),
        "blockwise": blockwise_int4,
        "bitdp": bitdp,
        "powersgd": powersgd,
        "demo": demo,
    }
    ns = {"lp": lion["lp8"] * 1e9 / sample, "1bit": lion["1bit"] * 1e9 / sample}
    ns.update({k: median_seconds(fn, 3, dev) * 1e9 / sample for k, fn in timed.items()})
    ns.update(_optimizer_ns(dev, sample))
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU, one thread"
    return ns, name


def _optimizer_ns(dev: torch.device, sample: int, repeat: int = 5) -> dict[str, float]:
    """Nanoseconds per element of 1-bit Adam's and 1-bit LAMB's compression-stage step beyond
    AdamW's, on ``sample`` parameters in :data:`OPTIMIZER_TENSORS` tensors, without a process
    group (their one-process path: the local arithmetic of their step, the codec apart)."""
    from lowbit_strategy import OneBitAdam, OneBitLamb

    size = max(1, sample // OPTIMIZER_TENSORS)
    gen = torch.Generator(device=dev).manual_seed(0)

    def params() -> list[torch.Tensor]:
        out = []
        for _ in range(OPTIMIZER_TENSORS):
            p = torch.randn(size, device=dev, generator=gen).requires_grad_(True)
            p.grad = torch.randn(size, device=dev, generator=gen) * 1e-2
            out.append(p)
        return out

    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)  # freeze_step=2's young-variance warning
    try:
        opts = {
            "adamw": torch.optim.AdamW(params(), lr=1e-3, weight_decay=0.1),
            "onebit_adam_step": OneBitAdam(params(), lr=1e-3, weight_decay=0.1, freeze_step=2),
            "onebit_lamb_step": OneBitLamb(params(), lr=1e-3, weight_decay=0.1, freeze_step=2),
        }
        for opt in opts.values():
            for _ in range(3):  # past the warm-up: the compression stage is timed
                opt.step()
        seconds = {k: median_seconds(opt.step, repeat, dev) for k, opt in opts.items()}
    finally:
        logging.disable(previous)
    numel = size * OPTIMIZER_TENSORS
    return {k: max(0.0, seconds[k] - seconds["adamw"]) * 1e9 / numel for k in OPTIMIZER_STEPS}


def _contended_worker(sample: int, processes: int, start, done, out) -> None:
    """One of :func:`_contended`'s processes: time, report, then keep the machine as busy as
    before until every process has reported."""
    torch.set_num_threads(1)
    start.wait()
    ns, _ = _measure_codecs(torch.device("cpu"), sample)
    out.put(ns)
    with done.get_lock():
        done.value += 1
    x = sample_values(sample)
    while done.value < processes:
        x.mul_(1.0001).abs_()


def _contended(sample: int, processes: int) -> tuple[dict, str]:
    """:func:`_measure_codecs` in ``processes`` one-thread processes at once (spawned: a
    forked torch may hang in its thread pools); the mean of their figures."""
    ctx = mp.get_context("spawn")
    start, done, out = ctx.Barrier(processes), ctx.Value("i", 0), ctx.Queue()
    procs = [
        ctx.Process(target=_contended_worker, args=(sample, processes, start, done, out), daemon=True)
        for _ in range(processes)
    ]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
    ns = {k: statistics.mean(r[k] for r in results) for k in results[0]}
    return ns, f"CPU, {processes} one-thread processes at once on {os.cpu_count()} cores"


def _backend() -> str:
    """The process group :func:`_init` joins: NCCL with one GPU per local rank (set as this
    rank's device); where the node has fewer GPUs than local ranks, which NCCL refuses
    ("Duplicate GPU detected"), gloo with CUDA tensors (``cpu:gloo,cuda:gloo``) on GPU
    ``LOCAL_RANK mod count``; gloo on a machine without CUDA. :func:`run`'s note says which."""
    if not torch.cuda.is_available():
        return "gloo"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
    count = torch.cuda.device_count()
    torch.cuda.set_device(local % count)
    return "nccl" if local_world <= count else "cpu:gloo,cuda:gloo"


def _init() -> tuple[int, int, int]:
    """(rank, world size, ranks per node), joining the launcher's process group if needed."""
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise PlanError("--measure", None, "run it under torchrun (or a launcher exporting RANK and WORLD_SIZE)")
        dist.init_process_group(_backend(), timeout=timedelta(seconds=120))
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    if per_node < 1 or world % per_node:
        raise PlanError("LOCAL_WORLD_SIZE", per_node, f"must divide the world size {world}: nodes of equal size")
    return rank, world, per_node


def _compute_seconds(args, device: torch.device) -> float | None:
    """Forward + backward of ``--model`` on ``--inputs``'s batch, slowest rank's median."""
    if not (args.model and getattr(args, "inputs", None)):
        return None
    mod, _, attr = args.model.partition(":")
    imod, _, iattr = args.inputs.partition(":")
    model = getattr(importlib.import_module(mod), attr)().to(device)
    batch = getattr(importlib.import_module(imod), iattr)()
    batch = tuple(b.to(device) for b in (batch if isinstance(batch, (tuple, list)) else (batch,)))

    def step():
        out = model(*batch)
        out = out if isinstance(out, torch.Tensor) else out[0]
        out.float().mean().backward()

    mine = torch.tensor([median_seconds(step, 3, device)], dtype=torch.float64, device=device)
    g.all_reduce_max(mine, None, "plan.compute")
    return float(mine.item())


def _fits(world: int, per_node: int, device: torch.device) -> dict[str, LinkFit | None]:
    nodes = world // per_node
    # every rank creates every group, in the same order (torch.distributed requires it)
    intra = [dist.new_group(list(range(k * per_node, (k + 1) * per_node))) for k in range(nodes)]
    inter = [dist.new_group(list(range(j, world, per_node))) for j in range(per_node)]
    rank = dist.get_rank()
    run = partial(probe, None, device=device, budget_s=BUDGET_S, sizes=SIZES)
    out: dict[str, LinkFit | None] = {"all_reduce": None, "all_to_all": None, "all_gather": None, "intra": None}
    if nodes > 1:
        out["all_reduce"] = run(over=inter[rank % per_node], kind="all_reduce")
        out["all_to_all"] = run(over=inter[rank % per_node], kind="all_to_all")
        out["all_gather"] = run(over=inter[rank % per_node], kind="all_gather")
    if per_node > 1:
        out["intra"] = run(over=intra[rank // per_node], kind="all_reduce")
    return out


@dataclasses.dataclass
class Measured:
    """What :func:`run` measured, agreed by every rank: the link between nodes per node
    (Gbit/s, µs; None on one node), inside a node per GPU, the compute seconds, the layout,
    a note for the assumptions, the raw fits for ``--json``, and whether this rank prints."""

    link: tuple[float, float] | None
    intra: tuple[float, float] | None
    compute_s: float | None
    nodes: int
    per_node: int
    note: str
    fits: dict
    printer: bool


def run(args) -> Measured:
    """Measure (module docstring) on every rank of the launcher's world."""
    started = time.perf_counter()
    rank, world, per_node = _init()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    fits = _fits(world, per_node, device)
    compute = _compute_seconds(args, device)
    nodes = world // per_node
    notes, link, intra = [], None, None
    ar, a2a, ag = fits["all_reduce"], fits["all_to_all"], fits["all_gather"]
    if ar is not None and a2a is not None and ag is not None:
        link = (ar.bandwidth_gbps * per_node, ar.latency_us)
        notes.append(
            f"between nodes: allreduce {ar.bandwidth_gbps:.3g}, all-to-all {a2a.bandwidth_gbps:.3g}, all-gather "
            f"{ag.bandwidth_gbps:.3g} Gbit/s per rank with all {per_node} local ranks sending "
            f"-> {link[0]:.3g} Gbit/s per node (allreduce), alpha {link[1]:.0f} us"
        )
    else:
        notes.append(f"one node: the link between nodes is not measured ({args.link} assumed)")
    if fits["intra"] is not None:
        intra = (fits["intra"].bandwidth_gbps, fits["intra"].latency_us)
        notes.append(f"inside a node: {intra[0]:.3g} Gbit/s per GPU")
    if device.type == "cuda" and "nccl" not in str(dist.get_backend()):
        notes.append(f"over {dist.get_backend()}, not NCCL (more local ranks than GPUs): slower than NCCL would be")
    seconds = time.perf_counter() - started
    note = f" (measured on {world} ranks in {seconds:.1f} s: " + "; ".join(notes) + ")"
    fit_json: dict = {
        k: None if f is None else {**dataclasses.asdict(f), "points": [list(p) for p in f.points]}
        for k, f in fits.items()
    }
    fit_json["compute_s"] = compute
    return Measured(link, intra, compute, nodes, per_node, note, fit_json, rank == 0)
