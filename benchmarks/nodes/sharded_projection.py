"""Projected cross-node time per step of the sharded layout on published cluster shapes, from
the cost model (:mod:`lowbit_strategy.pricing.sharded`, checked byte for byte
against the traffic logs at 2 x 2 by ``tests/integrations/test_sharded_bytes.py``)::

    python -m benchmarks.nodes --sharded --project    # -> results/nodes/nodes_sharded_projection.{md,png}

8 nodes x 8 GPUs, 25 and 100 Gbit/s between nodes, a 124M GPT-2 small shape, a 1.3B GPT (GPT-3
XL shape) and an 8B Llama-3 shape, FSDP2 over each node's 8 GPUs (every block a unit, then the
root), HSDP fp32 and bf16 against each sharded algorithm in its default form, resolved by the
package's own planners for the cluster (:data:`ASSUME`); and one FSDP group over all 64 GPUs
(``fsdp_shard="world"``, :mod:`lowbit_strategy.pricing.world`, NCCL's ring),
exact (fp32; bf16 with bf16 parameters) or with the quantized reduce-scatter (bf16 parameters:
int8/int4 one hop, int4 two hops), its parameter all-gathers counted in forward and backward.
"""
from __future__ import annotations

import math
from pathlib import Path

from benchmarks.nodes import sharded_cost
from benchmarks.harness.host import RESULTS
from lowbit_strategy import LowBitConfig, buckets
from lowbit_strategy.pricing import sharded as cs
from lowbit_strategy.pricing import world as cw
from lowbit_strategy.pricing.nodes import Cluster

#: the projection's assumptions (the module docstring of :mod:`benchmarks.collectives.bytes_vs_p` uses the same)
ASSUME = dict(nodes=8, ranks_per_node=8, links_gbps=(25.0, 100.0), latency_us=20.0, bucket_mb=25.0,
              flops_per_s=0.4 * 312e12, tokens_per_gpu=8 * 1024, backward_share=2 / 3)


def compute_seconds(model: sharded_cost.ShardedModel) -> float:
    """``6·params·tokens`` FLOPs per GPU at :data:`ASSUME`'s rate (40 % of an A100's bf16 peak)."""
    return 6 * model.numel * ASSUME["tokens_per_gpu"] / ASSUME["flops_per_s"]


def step_seconds(kind: str, compute: float, comm: float | tuple[float, float]) -> float:
    """Compute plus the exposed cross-node time: HSDP's per-unit all-reduce runs during backward
    (FSDP's all-reduce stream), and so does the sharded algorithms' exchange (started as FSDP
    assigns each unit's gradients), so only what exceeds backward shows; FSDP over the
    world (``comm`` = its forward and backward seconds) prefetches its all-gathers and
    reduce-scatters per unit, so what exceeds forward (1/3 of compute) and backward shows."""
    if isinstance(comm, tuple):
        share = ASSUME["backward_share"]
        return compute + max(0.0, comm[0] - (1 - share) * compute) + max(0.0, comm[1] - share * compute)
    return compute + max(0.0, comm - ASSUME["backward_share"] * compute)


def gpt_model(d: int, layers: int, vocab: int, context: int) -> sharded_cost.ShardedModel:
    """``examples/gpt_lion.py``'s GPT (tied head, biases, LayerNorms), in its parameter order."""
    block = ((d,), (d,), (d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,))
    root = ((vocab, d), (context, d), (d,), (d,))
    return sharded_cost.ShardedModel(root[:2] + block * layers + root[2:], (block,) * layers + (root,))


def llama_model(d: int, layers: int, vocab: int, kv: int, ffn: int) -> sharded_cost.ShardedModel:
    """A Llama-3 shape: grouped-query attention (``kv`` key/value features), SwiGLU, RMSNorm
    weights, untied embedding and head."""
    block = ((d, d), (kv, d), (kv, d), (d, d), (ffn, d), (ffn, d), (d, ffn), (d,), (d,))
    root = ((vocab, d), (d,), (vocab, d))
    return sharded_cost.ShardedModel(root[:1] + block * layers + root[1:], (block,) * layers + (root,))


MODELS = {
    "124M (GPT-2 small shape)": gpt_model(768, 12, 50257, 1024),
    "1.3B (GPT-3 XL shape)": gpt_model(2048, 24, 50257, 2048),
    "8B (Llama-3 8B shape)": llama_model(4096, 32, 128256, 1024, 14336),
}

#: (label, configuration kind); each in its default form
ROWS = (
    ("HSDP fp32 all-reduce", "hsdp_fp32"),
    ("HSDP bf16 all-reduce", "hsdp_bf16"),
    ("Lion Cub (auto)", "lion"),
    ("Lion Cub 1-bit", "lion_1bit"),
    ("1-bit Adam", "onebit_adam"),
    ("TurboQuant-Adam (auto form)", "turboquant"),
    ("FSDP world fp32 (exact)", "fsdp_fp32"),
    ("FSDP world bf16 (exact)", "fsdp_bf16"),
    ("FSDP world, int8 RS one hop", "fsdp_int8"),
    ("FSDP world, int4 RS one hop", "fsdp_int4"),
    ("FSDP world, int4 RS two hops", "fsdp_int4_2hop"),
)


def world(kind: str, model: sharded_cost.ShardedModel) -> tuple[cw.WorldSends, str]:
    """One step of one FSDP group over all the cluster's GPUs (the root is the models' last unit)."""
    rs = kind.removeprefix("fsdp_").removesuffix("_2hop")
    params = 4 if rs == "fp32" else 2
    out = cw.world_sends(model.units, ASSUME["nodes"], ASSUME["ranks_per_node"], reduce_scatter=rs,
                         two_hop=kind.endswith("_2hop"), param_itemsize=params, reduce_itemsize=params, root=-1)
    return out, f"{'fp32' if params == 4 else 'bf16'} all-gather"


def sends(kind: str, model: sharded_cost.ShardedModel, gbps: float) -> tuple[cs.ShardedSends, str]:
    """One compressed-stage step of ``kind`` on the cluster, and the form it runs in."""
    from lowbit_strategy.algorithms.lion_cub.mode import resolve_mode
    from lowbit_strategy.algorithms.turboquant.form import choose_form

    n, per_node = ASSUME["nodes"], ASSUME["ranks_per_node"]
    numel = buckets.bucket_numel(ASSUME["bucket_mb"])
    link = {"link_bandwidth_gbps": gbps, "link_latency_us": ASSUME["latency_us"]}
    if kind.startswith("hsdp"):
        return sharded_cost.step_sends(kind, model, n, per_node), "–"
    if kind.startswith("lion"):
        cfg = LowBitConfig(algorithm="lion", mode="1bit" if kind == "lion_1bit" else "auto", **link)
        local = sum(math.prod(cs.local_shape(s, per_node, 0)) for s in model.shapes)
        name = sharded_cost.lion_collective(resolve_mode(cfg, n, min(numel, local)))
        return sharded_cost.step_sends("lion", model, n, per_node, bucket_numel=numel, collective=name), name
    if kind == "onebit_adam":
        block = LowBitConfig(algorithm="onebit_adam").onebit_adam.scale_block
        out = sharded_cost.step_sends(kind, model, n, per_node, bucket_numel=numel, block=block)
        return out, f"compensated, scale block {block}"
    section = LowBitConfig(algorithm="turboquant").turboquant
    chosen: set[str] = set()

    def form(m: int) -> str:
        f = choose_form(section.form, n, m, ASSUME["latency_us"] * 1e-6, gbps * 1e9)
        chosen.add(f)
        return cs.TURBOQUANT[f]

    out = sharded_cost.step_sends(kind, model, n, per_node, bucket_numel=numel, collective=form,
                                  block=section.block, bits=4)
    return out, "/".join(sorted(chosen))


def project() -> dict:
    """``{model: {label: {gbps: (bytes per node, cross-node seconds, form, step seconds)}}}``."""
    out: dict = {}
    for model_name, model in MODELS.items():
        rows = out[model_name] = {}
        for label, kind in ROWS:
            cells = rows[label] = {}
            for gbps in ASSUME["links_gbps"]:
                cluster = Cluster(ASSUME["nodes"], ASSUME["ranks_per_node"], gbps,
                                  inter_latency_us=ASSUME["latency_us"])
                if kind.startswith("fsdp_"):
                    w, form = world(kind, model)
                    parts = cw.world_seconds(w, cluster)
                    cells[gbps] = (w.link, sum(parts), form, step_seconds(kind, compute_seconds(model), parts))
                    continue
                s, form = sends(kind, model, gbps)
                comm = cs.sharded_seconds(s, cluster)
                cells[gbps] = (s.network_per_node, comm, form, step_seconds(kind, compute_seconds(model), comm))
    return out


def markdown(result: dict, plotted: str) -> str:
    links = ASSUME["links_gbps"]
    lines = [
        "# Sharded layout: projected cross-node time per step",
        "",
        "`python -m benchmarks.nodes --sharded --project` "
        "(`lowbit_strategy.pricing.sharded`, via `benchmarks/nodes/sharded_cost.py`).",
        "",
        f"{ASSUME['nodes']} nodes × {ASSUME['ranks_per_node']} GPUs; FSDP2 over each node's GPUs (every block a "
        "unit, then the root); across nodes HSDP's all-reduce of each unit's gradient shard, or each sharded "
        "algorithm's exchange on every local rank's shards, in its default form as the package's planners choose "
        f"it for the cluster's link. One link per node of the stated bandwidth, {ASSUME['latency_us']:g} µs "
        f"latency, {ASSUME['bucket_mb']:g} MiB buckets; the compressed stage (after warm-ups, which cost what HSDP "
        "fp32 costs); seconds = latency rounds of the slowest local rank + bytes on the node's link ÷ bandwidth. "
        "Not counted: codec time, FSDP's own traffic inside the node (NVLink). **FSDP world** rows: one FSDP group "
        "over all GPUs, so every unit's all-gather (in forward, and again in backward but for the root) and its "
        "reduce-scatter cross nodes (NCCL's ring: one ring edge per node; the quantized one hop: the rows for other "
        "nodes' ranks, L·(W−L) per node; two hops: L·(N−1)); parameters all-gathered in bf16 except in the fp32 "
        "row; each GPU holds 1/64 of the model and optimizer state instead of 1/8.",
        "",
        "**step s**: compute (`6·params·tokens`, 8 × 1024 tokens per GPU at 40 % of an A100's 312 TFLOP/s) plus "
        "the cross-node time that shows: HSDP's all-reduce runs per unit during backward (taken as 2/3 of compute), "
        "and so does the sharded algorithms' exchange (started as FSDP assigns each unit's gradients), so only "
        "what exceeds backward shows; FSDP world's all-gathers and reduce-scatters run per unit, prefetched, so only what exceeds "
        "forward (1/3 of compute) and backward shows. "
        "**cross-node s** in brackets: HSDP fp32's ÷ this, HSDP bf16's ÷ this; **step s** in "
        "brackets: HSDP bf16's step ÷ this (above 1: faster than HSDP bf16).",
        "",
    ]
    for model_name, rows in result.items():
        fp32, bf16 = rows["HSDP fp32 all-reduce"], rows["HSDP bf16 all-reduce"]
        compute = compute_seconds(MODELS[model_name])
        lines += [f"## {model_name}: {MODELS[model_name].numel / 1e9:.2f}B parameters, compute {compute:.2f} s/step",
                  "",
                  "| configuration | form | GB/node/step | " + " | ".join(
                      f"{g:g} Gbit/s: cross-node s (vs fp32, bf16) | step s (vs bf16)" for g in links) + " |",
                  "|---|---|---:|" + "---:|---:|" * len(links)]
        for label, cells in rows.items():
            forms = sorted({f for c in cells.values() for f in c[2].split("/")})
            out = [f"{label}", "/".join(forms), f"{cells[links[0]][0] / 1e9:,.3f}"]
            for g in links:
                t, step = cells[g][1], cells[g][3]
                out += [f"{t:.3f} ({fp32[g][1] / t:.1f}×, {bf16[g][1] / t:.1f}×)",
                        f"{step:.2f} ({bf16[g][3] / step:.2f}×)"]
            lines.append("| " + " | ".join(out) + " |")
        lines.append("")
    lines.append(plotted)
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> str:
    """A bar chart of seconds per step (log scale); a sentence saying where it is, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "No plot: matplotlib is not installed in this environment."
    labels = [label for label, _ in ROWS]
    series = [(m, g) for m in result for g in ASSUME["links_gbps"]]
    fig, ax = plt.subplots(figsize=(13, 6))
    width = 0.8 / len(series)
    for k, (m, g) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ax.bar(xs, [result[m][label][g][1] for label in labels], width, label=f"{m}, {g:g} Gbit/s")
    ax.set_xticks(range(len(labels)), labels, rotation=15, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("cross-node seconds per step")
    ax.set_title(f"Sharded layout, {ASSUME['nodes']} nodes × {ASSUME['ranks_per_node']} GPUs (cost model)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"Plot: `{path.name}`."


def main(stem: Path | None = None) -> int:
    stem = stem or RESULTS / "nodes" / "nodes_sharded_projection"
    stem.parent.mkdir(parents=True, exist_ok=True)
    result = project()
    text = markdown(result, plot(result, stem.with_suffix(".png")))
    stem.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {stem}.md")
    return 0
