"""``lowbit-plan`` (``python -m lowbit_strategy.plan``): will low-bit sync pay for this model
on this cluster, and with which method? A table per method and form, and one sentence.

::

    lowbit-plan --hf-config llama3-8b/config.json --nodes 8 --gpus-per-node 8 --link 25gbit \\
        --gpu h100 --tokens-per-step 4e6
    lowbit-plan --params 1.3e9 --nodes 2 --gpus-per-node 4 --link 100mbit --compute-s 0.5 --json
    torchrun --nnodes 2 --nproc-per-node 4 ... -m lowbit_strategy.plan --measure --params 1.3e9

Nothing is trained and nothing is downloaded; ``--measure`` (under any launcher) measures the
link (and the compute step of ``--model``) instead of taking ``--link``
(:mod:`lowbit_strategy.plan.measure`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from lowbit_strategy.plan import inputs, predict, recommend, warmup
from lowbit_strategy.pricing.nodes import Cluster

#: where a GPU run leaves codec timings (ns per element by codec), read when present
GPU_CODECS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu" / "codecs.json"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lowbit-plan", description=__doc__.split("\n\n")[0].strip())
    model = ap.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=float, help="parameter count, e.g. 8e9")
    model.add_argument("--hf-config", help="a local Hugging Face config.json (no download)")
    model.add_argument("--model", help="pkg.mod:factory returning an nn.Module (built on the meta device)")
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--link", default="25gbit", help="each node's link to the others (25gbit, 100mbit, 3.2tbit)")
    ap.add_argument("--latency-us", type=float, default=20.0, help="latency of one message between nodes")
    ap.add_argument(
        "--intra-link", default=None, help="per-GPU link inside a node (default: --gpu's NVLink/PCIe, else 2400gbit)"
    )
    ap.add_argument("--intra-latency-us", type=float, default=5.0)
    ap.add_argument("--compute-s", type=float, help="forward + backward seconds per step on one GPU")
    ap.add_argument("--gpu", help=f"estimate compute from its FLOP/s: {', '.join(inputs.GPU_FLOPS)}")
    ap.add_argument("--tokens-per-step", type=float, help="tokens per optimizer step over all GPUs")
    ap.add_argument("--mfu", type=float, default=inputs.DEFAULT_MFU, help="assumed model FLOP utilization")
    ap.add_argument("--bucket-mb", type=float, default=25.0, help="LowBitConfig.bucket_size_mb")
    ap.add_argument(
        "--sharded",
        action="store_true",
        help="add the sharded rows (FSDP2 inside each node; on several nodes also one FSDP group over every rank)",
    )
    ap.add_argument("--codecs", help="JSON of codec ns per element ({'ns_per_element': {...}, 'device': ...})")
    ap.add_argument("--measure-codecs", action="store_true", help="time the codecs on this machine")
    ap.add_argument(
        "--codec-processes",
        type=int,
        default=1,
        help="with --measure-codecs on a CPU: time them in this many processes at once, the ranks the planned "
        "run puts on this machine (their contention for its cores)",
    )
    ap.add_argument("--measure", action="store_true", help="measure the link (run under torchrun or any launcher)")
    ap.add_argument("--inputs", help="with --measure and --model: pkg.mod:fn returning one GPU's batch")
    ap.add_argument(
        "--steps",
        type=int,
        help="the run's optimizer steps: price the whole run, full-precision warm-ups included "
        "(without it: the steady-state step)",
    )
    ap.add_argument(
        "--powersgd-start",
        type=int,
        help=f"with --steps: PowerSGD's fp32 steps (start_powerSGD_iter; default torch's {warmup.POWERSGD_START})",
    )
    ap.add_argument(
        "--freeze-step",
        type=int,
        help=f"with --steps: 1-bit Adam/LAMB's freeze_step "
        f"(default {warmup.ONEBIT_FREEZE_SHARE * 100:.0f}%% of --steps)",
    )
    ap.add_argument(
        "--turboquant-warmup",
        type=int,
        help=f"with --steps: TurboQuant-Adam's warmup_steps (default {warmup.TURBOQUANT_WARMUP})",
    )
    ap.add_argument(
        "--warmup-wire",
        choices=warmup.WARMUP_WIRES,
        help="with --steps: what this package's warm-ups send (LowBitConfig.warmup_wire; default bf16)",
    )
    ap.add_argument(
        "--diloco-sync-every",
        type=int,
        default=100,
        help="H of the DiLoCo rows (local updates: one outer sync every H steps; 0 leaves them out)",
    )
    ap.add_argument(
        "--no-demo", action="store_true", help="leave the DeMo rows out (decoupled momentum, top-k DCT coefficients)"
    )
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return ap


def _codecs(args) -> tuple[dict[str, float] | None, str]:
    """Codec ns per element: ``--codecs``, else ``--measure-codecs`` on this machine, else the GPU
    report a ``make gpu-check`` left (:data:`GPU_CODECS`), else none. Asked for, a measurement wins
    over the default report."""
    if args.codecs and args.measure_codecs:
        raise inputs.PlanError("--codecs", args.codecs, "pass either --codecs or --measure-codecs, not both")
    default = GPU_CODECS if GPU_CODECS.exists() and not args.measure_codecs else None
    path = Path(args.codecs) if args.codecs else default
    if path is not None:
        try:
            data = json.loads(path.read_text())
            ns = {str(k): float(v) for k, v in data["ns_per_element"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise inputs.PlanError(
                "--codecs", str(path), f"expected {{'ns_per_element': {{codec: ns}}}} ({exc})"
            ) from None
        return ns, f"codec times from {path.name} ({data.get('device', 'device not named')})"
    if args.measure_codecs:
        from lowbit_strategy.plan.measure import measure_codecs

        if args.codec_processes < 1:
            raise inputs.PlanError("--codec-processes", args.codec_processes, "pass 1 or more processes")
        ns, device = measure_codecs(processes=args.codec_processes)
        return ns, f"codec times measured on this machine's {device} (not the GPUs planned for)"
    return None, "codec time not counted (no GPU codec report; --measure-codecs times them on this machine)"


def _run(args) -> warmup.Run | None:
    """The run ``--steps`` prices, or None; a warm-up option without ``--steps`` is an error (it
    would change nothing)."""
    given = {
        field: value
        for field in ("powersgd_start", "freeze_step", "turboquant_warmup", "warmup_wire")
        if (value := getattr(args, field)) is not None
    }
    if args.steps is None:
        if given:
            field, value = next(iter(given.items()))
            option = "--" + field.replace("_", "-")
            raise inputs.PlanError(option, value, "pass --steps too: warm-ups are priced over a whole run")
        return None
    return warmup.Run(args.steps, **given)  # Run's defaults for the rest


def setup_from(args, link: tuple[float, float] | None = None, compute_s: float | None = None) -> predict.Setup:
    """The :class:`~.predict.Setup` of parsed arguments; ``link`` (Gbit/s, µs) and
    ``compute_s`` override them with measured figures."""
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise inputs.PlanError("--nodes/--gpus-per-node", (args.nodes, args.gpus_per_node), "both must be >= 1")
    if args.latency_us < 0 or args.intra_latency_us < 0:
        raise inputs.PlanError("--latency-us", args.latency_us, "latencies must be >= 0 microseconds")
    if not args.bucket_mb > 0:
        raise inputs.PlanError("--bucket-mb", args.bucket_mb, "pass a bucket size > 0 MB")
    if args.params is not None:
        model = inputs.from_params(args.params)
    elif args.hf_config is not None:
        model = inputs.from_hf_config(args.hf_config)
    else:
        model = inputs.from_factory(args.model)
    gbps, us = link or (inputs.parse_rate("--link", args.link), args.latency_us)
    intra = args.intra_link or inputs.GPU_INTRA_GBPS.get((args.gpu or "").lower(), 2400.0)
    cluster = Cluster(
        args.nodes,
        args.gpus_per_node,
        gbps,
        us,
        inputs.parse_rate("--intra-link", intra),
        args.intra_latency_us,
    )
    given = compute_s if compute_s is not None else args.compute_s
    compute = inputs.compute_time(model, cluster.world_size, given, args.gpu, args.tokens_per_step, args.mfu)
    if compute_s is not None:
        compute = dataclasses.replace(compute, note=f"compute {compute_s:.3g} s per step (measured)")
    run = _run(args)  # checked before --measure-codecs spends its seconds
    ns, note = _codecs(args)
    memory = inputs.GPU_MEMORY.get((args.gpu or "").lower())
    if args.diloco_sync_every < 0:
        raise inputs.PlanError(
            "--diloco-sync-every", args.diloco_sync_every, "DiLoCo's H: steps per round, >= 1 (0: no rows)"
        )
    return predict.Setup(
        model,
        cluster,
        compute,
        args.bucket_mb,
        args.sharded,
        ns,
        note,
        memory,
        run=run,
        diloco_sync_every=args.diloco_sync_every,
        demo=not args.no_demo,
    )


def assumptions(setup: predict.Setup, measured: str = "") -> list[str]:
    c = setup.cluster
    return [
        f"model: {setup.model.source}",
        f"cluster: {c.nodes} node(s) x {c.ranks_per_node} GPUs; between nodes {c.inter_gbps:g} Gbit/s per node, "
        f"{c.inter_latency_us:g} us; inside {c.intra_gbps:g} Gbit/s per GPU, {c.intra_latency_us:g} us" + measured,
        setup.compute.note,
        f"overlap: collectives started in backward hide behind it (backward = {predict.BACKWARD_SHARE:.2f} of "
        "compute) except the last bucket, the sharded rows' too (their exchange starts as FSDP assigns each unit's "
        "gradients); the FSDP world rows' "
        "gathers and reduce-scatters hide behind forward and backward but one unit's each; the DiLoCo rows "
        f"exchange every {setup.diloco_sync_every} steps, amortized per step (streaming: behind its delay); the DeMo "
        "rows all-gather every worker's payload each step (delay 1: behind the next step's compute)",
        setup.codec_note,
        "memory: optimizer + compression state per GPU, fp32; weights, gradients, activations not counted",
        f"buckets of {setup.bucket_size_mb:g} MB; "
        + (
            setup.run.describe()
            if setup.run
            else "steady state (warm-up steps send bf16 or fp32 and are not counted: --steps prices a whole run)"
        ),
    ] + (
        [f"'!': does not fit {setup.gpu_memory / 1e9:.0f} GB per GPU with fp32 weights and gradients (8 B/param)"]
        if setup.gpu_memory
        else []
    )


def _size(b: float) -> str:
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= f:
            return f"{b / f:.3g} {unit}"
    return f"{b:.0f} B"


def table(rows: list[predict.Row]) -> str:
    head = f"{'method':<26} {'form':<12} {'link bytes/step':>15} {'comm s':>8} {'exposed s':>9} {'codec s':>8} "
    run = bool(rows) and rows[0].run_s is not None
    head += (
        f"{'step s':>8} " + (f"{'warm-up':>7} {'run s':>8} " if run else "") + f"{'vs DDP bf16':>11} {'memory/GPU':>10}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        whole = f"{r.warmup_steps:>7} {r.run_s:>8,.0f} " if run else ""
        lines.append(
            f"{r.method:<26} {r.form:<12} {_size(r.link_bytes):>15} {r.comm_s:>8.3g} {r.exposed_s:>9.3g} "
            f"{r.codec_s:>8.3g} {r.step_s:>8.3g} {whole}{r.speedup:>10.2f}x {_size(r.memory_bytes):>10}"
            + ("!" if r.fits is False else "")
        )
    return "\n".join(lines)


def render(setup: predict.Setup, as_json: bool, measured: str = "", fit: dict | None = None) -> str:
    rows = predict.predict(setup)
    sentence = recommend.recommend(rows)
    notes = assumptions(setup, measured)
    if as_json:
        out = {
            "assumptions": notes,
            "rows": [dataclasses.asdict(r) for r in rows],
            "recommendation": sentence,
            "measured": fit,
        }
        return json.dumps(out, indent=2)
    return "\n".join(["Assumptions:", *(f"  - {a}" for a in notes), "", table(rows), "", sentence])


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.measure:
            from lowbit_strategy.plan.measure import run

            m = run(args)
            args.nodes, args.gpus_per_node = m.nodes, m.per_node
            if m.intra is not None:
                args.intra_link, args.intra_latency_us = f"{m.intra[0]}gbit", m.intra[1]
            if m.compute_s is None and args.compute_s is None and not (args.gpu and args.tokens_per_step):
                raise inputs.PlanError(
                    "--compute-s", None, "with --measure pass --model and --inputs, --compute-s or --gpu"
                )
            text = render(setup_from(args, m.link, m.compute_s), args.json, m.note, m.fits)
            if m.printer:  # rank 0 prints
                print(text)
            return 0
        print(render(setup_from(args), args.json))
    except inputs.PlanError as exc:
        print(f"lowbit-plan: {exc}", file=sys.stderr)
        return 2
    return 0
