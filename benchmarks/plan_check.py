"""``lowbit-plan``'s predictions against a recorded 2-nodes × 2-ranks run (:mod:`benchmarks.nodes`).

For every record of ``benchmarks/results/nodes.json`` (DDP and each algorithm, flat and
hierarchical, at 1 Gbit/s and 100 Mbit/s) the planner predicts the step time and the bytes on
each node's link for the same GPT (``examples/gpt_lion.py`` at the run's sizes), with the run's
own comm-free step (its calibration run, same optimizer family) as the compute time and codec
times measured on this CPU (the machine that ran the benchmark) under the run's contention: as
many one-thread processes at once as the run had ranks on this machine
(:func:`~lowbit_strategy.plan.measure.measure_codecs`, ``processes``; the calibration step
was measured under the same contention, so both terms are), with 1-bit Adam's and 1-bit
LAMB's step beyond AdamW's timed the same way (the calibration step is AdamW's). Two
predictions per row: at the
link's configured rate, and at the rate ``lowbit-plan --measure`` measured on the same emulated
links (:data:`MEASURED_GBPS`, allreduce payload rate: 98 % and 87 % of the shaper's rate, which also counts headers).

    python -m benchmarks.plan_check [--results benchmarks/results/nodes.json] [--no-codecs] [--processes 1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: per node, from `lowbit-plan --measure` under benchmarks.netem, 2 nodes × 2 ranks (2026-11-26)
MEASURED_GBPS = {"1gbit": 0.979, "100mbit": 0.0871}
#: gloo over loopback inside a node, per rank (`--measure` on the same runs: 4.3 and 6.3 Gbit/s)
INTRA_GBPS = 5.0
#: record config -> the planner's row key (per topology)
ROWS = {
    "ddp_lion": "ddp_fp32",
    "ddp_adamw": "ddp_fp32",
    "lowbit_lion": "lion_lp8_{form}",
    "lowbit_bitdp_adamw": "bitdp_{form}",
    "lowbit_adam": "onebit_{form}",
    "lowbit_lamb": "onebit_lamb_{form}",
    "lowbit_turboquant": "turboquant_{form}",
}


def gpt_model(sizes: dict):
    """The benchmark's GPT as the planner sees it (tied embeddings counted once; BitDP's own selection)."""
    import torch

    from examples.gpt_lion import GPT
    from lowbit_strategy.plan.inputs import from_module

    with torch.device("meta"):
        gpt = GPT(seq=sizes["seq"], d=sizes["d_model"], layers=sizes["layers"], heads=sizes["heads"])
    return from_module(gpt, "benchmark GPT")


def main(argv=None) -> int:
    from lowbit_strategy.collectives.cost_model_nodes import Cluster
    from lowbit_strategy.plan import predict
    from lowbit_strategy.plan.inputs import Compute
    from lowbit_strategy.plan.measure import measure_codecs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=str(ROOT / "benchmarks/results/nodes.json"))
    ap.add_argument("--no-codecs", action="store_true", help="leave codec time out")
    ap.add_argument(
        "--processes", type=int, help="codecs timed in this many processes at once (default: the run's ranks)"
    )
    args = ap.parse_args(argv)
    data = json.loads(Path(args.results).read_text())
    settings, records = data["settings"], data["records"]
    model = gpt_model(settings["model"])
    procs = args.processes or settings["nodes"] * settings["ranks_per_node"]
    codecs, how = (None, "not counted") if args.no_codecs else measure_codecs("cpu", processes=procs)
    print(f"codec and optimizer-step ns per element ({how}):", {k: round(v, 1) for k, v in (codecs or {}).items()})
    calib = {(r["config"], r["link"]): r["step_s"] for r in records if r["config"].startswith("calib_")}
    print(
        "| algorithm | topology | link | measured ms | predicted ms (configured rate) | predicted ms (measured rate) "
        "| link kB/step measured | predicted |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in records:
        key = ROWS.get(r["config"])
        if key is None:
            continue
        form = r.get("topology") or "flat"
        family = "calib_lion" if "lion" in r["config"] else "calib_adamw"
        compute = Compute(calib[(family, r["link"])], "the run's comm-free step")
        cells = []
        for gbps in (r["link_bps"] / 1e9, MEASURED_GBPS[r["link"]]):
            cluster = Cluster(settings["nodes"], settings["ranks_per_node"], gbps, 50.0, INTRA_GBPS, 50.0)
            # the form the run took: TurboQuant's auto compressed in every recorded run (its bytes)
            forms = predict.TURBOQUANT_FORMS[1:] if r["config"] == "lowbit_turboquant" else predict.TURBOQUANT_FORMS
            setup = predict.Setup(model, cluster, compute, 25.0, False, codecs, turboquant_forms=forms)
            row = next(x for x in predict.predict(setup) if x.key == key.format(form=form))
            cells.append(row)
        measured = r["step_s"] * 1e3
        kb = max(r["cross_node_bytes_per_node_per_step"]) / 1e3
        conf, meas = (c.step_s * 1e3 for c in cells)
        print(
            f"| {r['config']} | {form if r.get('topology') else '–'} | {r['link']} | {measured:.0f} | "
            f"{conf:.0f} ({conf / measured - 1:+.0%}) | {meas:.0f} ({meas / measured - 1:+.0%}) | {kb:.0f} | "
            f"{cells[0].link_bytes / 1e3:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
