"""Bytes each rank sends per synchronization, against P, for every method in this package.

    python -m benchmarks.collectives.bytes_vs_p [--numel 124000000] [--worlds 2,4,8,16,32]

Reduce-scatter based methods (Lion Cub's votes and lanes, the 1-bit allreduce of 1-bit
Adam/LAMB, the two-stage forms of BitDP and TurboQuant) keep their ratio to fp32 at any P;
all-gather based ones (BitDP's and TurboQuant's paper forms) send every rank's whole
payload to every peer, so they save less as P grows and lose to fp32 past 32/b ranks
(b = bits per element). The figures are the byte formulas the collectives' tests check
against the recorded traffic (bits per element, scales included: BitDP one float32 scale
per output channel, modeled here as rows of 1024 — its two-stage rows are the cost model's
exact formula for that layout, ``cost_model.bitdp_bytes``; TurboQuant one float32 per 1024;
1-bit Adam one float32 per 32768), for ``numel`` elements and the ring's ``2(P-1)/P`` factor.

Across nodes (``--clusters``): bytes per step on each node's link between nodes and the
projected step time, flat against hierarchical (every algorithm) and DDP, for N nodes of L GPUs
(:mod:`lowbit_strategy.pricing.nodes`: its per-bucket formulas are the bytes
the collectives record, checked at P up to 16 by ``tests/collectives/test_scaling.py``)::

    python -m benchmarks.collectives.bytes_vs_p --clusters [--out benchmarks/results]

writes ``bytes_vs_p.md`` (8 nodes × 8 GPUs at 25 and 100 Gbit/s, GPT-2 124M and a 1.3B
model; bytes per node against P) and ``bytes_vs_p.png``. Assumptions, all in :data:`ASSUME`:
the models' real parameter shapes (BitDP quantizes the linear weights, the embeddings stay
fp32), 25 MiB buckets, the compressed stage (after warm-ups), the overlap path's non-finite
flag; per node one link of the stated bandwidth, 20 µs latency; NVLink 300 GB/s and 5 µs
inside a node; compute ``6·params·tokens`` FLOPs per GPU at 40 % of an A100's 312 TFLOP/s,
8 × 1024 tokens per GPU per step; step time = compute + communication (no overlap: an upper
bound; with full overlap it is the larger of the two); codec time not counted.
"""

from __future__ import annotations

import argparse
import os

from lowbit_strategy import buckets
from lowbit_strategy.pricing import flat as cost_model
from lowbit_strategy.pricing import nodes as nodes_model
from lowbit_strategy.collectives.gathered import PayloadLayout
from lowbit_strategy.collectives.summed import lane_for

#: elements per scale of each method's payload (for the few bytes of scales)
ROW = 1024


def per_rank_bytes(method: str, p: int, n: int) -> float:
    """Bytes one rank sends for ``n`` elements at ``p`` ranks."""
    ring = 2 * (p - 1) / p
    gather = p - 1
    if method == "fp32 ring allreduce (DDP)":
        return ring * 4 * n
    if method == "Lion Cub 1-bit majority vote":
        return ring * n / 8
    if method == "Lion Cub sign votes (lane holding P)":
        return ring * n * lane_for(p, 1, signed=False).bits / 8
    if method == "Lion Cub 8-bit L1 lanes":
        return ring * n
    if method == "1-bit Adam/LAMB compensated allreduce":
        return ring * (n / 8 + 4 * n / 32768)
    if method == "BitDP 2-bit all-gather":
        return gather * (n / 4 + 4 * n / ROW)
    if method == "BitDP 1-bit all-gather":
        return gather * (n / 8 + 4 * n / ROW)
    if method in ("BitDP 2-bit two-stage", "BitDP 1-bit two-stage"):
        return cost_model.bitdp_bytes("two_stage", _rows_layout(n, int(method[6])), p, flagged=False)
    if method == "TurboQuant 4-bit all-gather (paper)":
        return gather * n * cost_model._TQ_BITS / 8
    if method == "TurboQuant 4-bit two-stage":
        return ring * n * cost_model._TQ_BITS / 8
    raise ValueError(method)


def _rows_layout(n: int, bits: int) -> PayloadLayout:
    """``n`` elements as BitDP matrices of rows of :data:`ROW` (and one shorter row)."""
    shapes = [(n // ROW, ROW)] if n >= ROW else []
    return PayloadLayout.of(shapes + ([(1, n % ROW)] if n % ROW else []), bits)


METHODS = (
    "fp32 ring allreduce (DDP)",
    "Lion Cub 1-bit majority vote",
    "Lion Cub sign votes (lane holding P)",
    "Lion Cub 8-bit L1 lanes",
    "1-bit Adam/LAMB compensated allreduce",
    "BitDP 2-bit all-gather",
    "BitDP 1-bit all-gather",
    "BitDP 2-bit two-stage",
    "BitDP 1-bit two-stage",
    "TurboQuant 4-bit all-gather (paper)",
    "TurboQuant 4-bit two-stage",
)


def table(n: int, worlds: list[int]) -> str:
    head = "| method | " + " | ".join(f"P = {p}" for p in worlds) + " |"
    rows = [head, "|---|" + "---:|" * len(worlds)]
    for method in METHODS:
        cells = []
        for p in worlds:
            b, fp32 = per_rank_bytes(method, p, n), per_rank_bytes(METHODS[0], p, n)
            cells.append(f"{b / 2**20:,.0f} MiB ({fp32 / b:.1f}×)" if method != METHODS[0] else f"{b / 2**20:,.0f} MiB")
        rows.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# ---- across nodes: bytes per node and step time (cost_model_nodes) --------------------------
#: the projections' assumptions (module docstring)
ASSUME = dict(
    bucket_mb=25.0,
    inter_latency_us=20.0,
    intra_gbps=2400.0,
    intra_latency_us=5.0,
    flops_per_s=0.4 * 312e12,
    tokens_per_gpu=8 * 1024,
)


def gpt_params(d: int, layers: int, vocab: int, context: int) -> list[tuple[tuple[int, int] | None, int]]:
    """A GPT's parameters in registration order: ``(channel matrix (rows, cols) if BitDP
    quantizes it, else None; numel)``: the embeddings (the head is tied) and every bias and
    norm full precision, the four linear weights of each block quantized."""
    out: list[tuple[tuple[int, int] | None, int]] = [(None, vocab * d), (None, context * d)]
    for _ in range(layers):
        for rows, cols in ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d)):
            out += [((rows, cols), rows * cols), (None, rows)]
        out += [(None, 2 * d), (None, 2 * d)]  # the two layer norms
    return out + [(None, 2 * d)]


MODELS = {
    "GPT-2 124M": gpt_params(768, 12, 50257, 1024),
    "1.3B (GPT-3 XL shape)": gpt_params(2048, 24, 50257, 2048),
}

#: (label, collective, bucket_sends keywords, shard alignment across nodes)
ALGORITHMS = (
    ("Lion Cub 1-bit vote", "1bit", {}, 64),
    ("Lion Cub sign votes", "sign", {}, 64),
    ("Lion Cub 8-bit L1 lanes", "lp8", {}, 64),
    ("Lion Cub fp32 sum", "fp32", {}, 64),
    ("1-bit Adam/LAMB", "compensated", {"block": 32768, "flagged": False}, 32768),
    ("BitDP 2-bit all-gather", "bitdp:allgather", {}, 0),
    ("BitDP 2-bit two-stage", "bitdp:two_stage", {}, 0),
    ("TurboQuant 4-bit all-gather", "turboquant_allgather", {"block": 1024, "flagged": False}, 1024),
    ("TurboQuant 4-bit two-stage", "turboquant_two_stage", {"block": 1024, "flagged": False}, 1024),
)
DDP = ("DDP (fp32 ring allreduce)", "ddp", {"flagged": False}, 64)


def step_cost(algo, params, cluster: nodes_model.Cluster, hierarchical: bool) -> tuple[float, float]:
    """``(bytes on one node's link, seconds of communication)`` of one step of ``algo`` for a
    model of ``params`` (DDP's bucket order: the last parameters first) on ``cluster``."""
    _, name, kw, align = algo
    order = params[::-1]
    n_nodes, per_node, p = cluster.nodes, cluster.ranks_per_node, cluster.world_size
    link = seconds = 0.0
    for idx in buckets.partition([k for _, k in order], buckets.bucket_numel(ASSUME["bucket_mb"])):
        members = [order[i] for i in idx]
        n = sum(k for _, k in members)
        sends: nodes_model.Sends | nodes_model.NodeSends
        if name.startswith("bitdp:"):
            shapes = [s for s, _ in members if s is not None]
            full = sum(k for s, k in members if s is None)
            form = name.split(":")[1]
            if hierarchical:
                sends = nodes_model.bitdp_hierarchical_sends(form, shapes, full, n_nodes, per_node)
            else:
                sends = nodes_model.bitdp_sends(form, shapes, full, p)
        elif hierarchical:
            sends = nodes_model.hierarchical_sends(name, n, n_nodes, per_node, align=align, **kw)
        else:
            sends = nodes_model.bucket_sends(name, n, p, **kw)
        link += sends.network_per_node if isinstance(sends, nodes_model.NodeSends) else sends.link_bytes(p, per_node)
        seconds += nodes_model.bucket_seconds(sends, cluster)
    return link, seconds


def compute_seconds(params) -> float:
    return 6 * sum(k for _, k in params) * ASSUME["tokens_per_gpu"] / ASSUME["flops_per_s"]


def _cluster(n_nodes: int, per_node: int, gbps: float) -> nodes_model.Cluster:
    kw = {k: ASSUME[k] for k in ("inter_latency_us", "intra_gbps", "intra_latency_us")}
    return nodes_model.Cluster(n_nodes, per_node, gbps, **kw)


def _rows():
    yield DDP, False
    for algo in ALGORITHMS:
        yield algo, False
        yield algo, True


def projection_table(model: str, n_nodes: int, per_node: int, links: tuple[float, ...]) -> str:
    """Bytes per node and step time on ``n_nodes`` x ``per_node`` at each link (Gbit/s)."""
    params = MODELS[model]
    compute = compute_seconds(params)
    head = "| algorithm | topology | MB/node | vs DDP | " + " | ".join(
        f"{g:g} Gbit/s: comm ms | step ms | vs DDP" for g in links
    )
    rows = [head + " |", "|---|---|---:|---:|" + "---:|---:|---:|" * len(links)]
    ddp = {g: step_cost(DDP, params, _cluster(n_nodes, per_node, g), False) for g in links}
    for algo, hier in _rows():
        cells = []
        for g in links:
            link, comm = step_cost(algo, params, _cluster(n_nodes, per_node, g), hier)
            cells.append(
                f"{1e3 * comm:,.1f} | {1e3 * (compute + comm):,.0f} | {(compute + ddp[g][1]) / (compute + comm):.2f}×"
            )
        topology = "hierarchical" if hier else ("–" if algo is DDP else "flat")
        ratio = ddp[links[0]][0] / link if link else float("inf")
        rows.append(f"| {algo[0]} | {topology} | {link / 1e6:,.1f} | {ratio:.1f}× | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def summary_table(n_nodes: int, per_node: int, links: tuple[float, ...]) -> str:
    """Every model side by side: MB on each node's link per step, and step ms (× DDP's) per link."""
    head, rule = "| algorithm | topology |", "|---|---|"
    for model in MODELS:
        short = model.split(" (")[0]
        head += f" {short}: MB/node |" + "".join(f" {g:g} Gbit/s ms |" for g in links)
        rule += "---:|" * (1 + len(links))
    rows = [head, rule]
    costs = {
        (algo[0], hier, model, g): step_cost(algo, MODELS[model], _cluster(n_nodes, per_node, g), hier)
        for algo, hier in _rows()
        for model in MODELS
        for g in links
    }
    for algo, hier in _rows():
        cells = []
        for model in MODELS:
            compute = compute_seconds(MODELS[model])
            cells.append(f"{costs[(algo[0], hier, model, links[0])][0] / 1e6:,.0f}")
            for g in links:
                step = compute + costs[(algo[0], hier, model, g)][1]
                ddp = compute + costs[(DDP[0], False, model, g)][1]
                cells.append(f"{1e3 * step:,.0f} ({ddp / step:.1f}×)")
        topology = "hierarchical" if hier else ("–" if algo is DDP else "flat")
        rows.append(f"| {algo[0]} | {topology} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _per_node_bytes(algo, model: str, per_node: int, worlds: list[int], hierarchical: bool) -> list[float | None]:
    out: list[float | None] = []
    for p in worlds:
        try:
            out.append(step_cost(algo, MODELS[model], _cluster(p // per_node, per_node, 100.0), hierarchical)[0])
        except OverflowError:  # an 8-bit lane cannot hold the sum of this many workers
            out.append(None)
    return out


def scaling_table(model: str, per_node: int, worlds: list[int]) -> str:
    """Bytes on each node's link per step against P (nodes of ``per_node`` ranks)."""
    rows = ["| algorithm | topology | " + " | ".join(f"P = {p}" for p in worlds) + " |"]
    rows.append("|---|---|" + "---:|" * len(worlds))
    for algo, hier in _rows():
        values = _per_node_bytes(algo, model, per_node, worlds, hier)
        cells = ["–" if v is None else f"{v / 1e6:,.0f}" for v in values]
        topology = "hierarchical" if hier else ("–" if algo is DDP else "flat")
        rows.append(f"| {algo[0]} | {topology} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(path: str, model: str, per_node: int, worlds: list[int]) -> None:
    """Cross-node MB per node per step against P: flat (left) and hierarchical (right), DDP in both."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5.6), sharey=True)
    colors = plt.get_cmap("tab10")
    for ax, hier in zip(axes, (False, True)):
        ddp = _per_node_bytes(DDP, model, per_node, worlds, False)
        ax.plot(worlds, [v / 1e6 for v in ddp if v is not None], "k-", lw=2.5, label=DDP[0])
        for i, algo in enumerate(ALGORITHMS):
            values = _per_node_bytes(algo, model, per_node, worlds, hier)
            xs = [p for p, v in zip(worlds, values) if v is not None]
            style = "s--" if algo[1] in ("compensated", "fp32") else "o-"  # (on top of Lion's 1-bit vote / DDP)
            ax.plot(xs, [v / 1e6 for v in values if v is not None], style, ms=3, color=colors(i), label=algo[0])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"P (ranks; nodes of {per_node})")
        ax.set_title("hierarchical: the node is the worker" if hier else "flat: every rank a worker")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("MB per step on each node's cross-node link")
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=5, fontsize=8)
    fig.suptitle(f"{model}: bytes leaving each node per step (cost model; 25 MiB buckets)")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)


def clusters(out_dir: str) -> str:
    worlds = [16, 32, 64, 128, 256, 512]
    parts = [
        "# Bytes per node across nodes, and projected step time",
        "",
        "`python -m benchmarks.collectives.bytes_vs_p --clusters` (cost model: "
        "`lowbit_strategy/pricing/nodes.py`; assumptions in the module docstring of "
        "`benchmarks/collectives/bytes_vs_p.py`).",
    ]
    parts += [
        "",
        "## 8 nodes × 8 GPUs: MB per step on each node's link; step ms (DDP's step time ÷ this)",
        "",
        summary_table(8, 8, (25.0, 100.0)),
    ]
    for model in MODELS:
        compute = compute_seconds(MODELS[model])
        parts += [
            "",
            f"## {model}: 8 nodes × 8 GPUs (compute {1e3 * compute:,.0f} ms per step)",
            "",
            projection_table(model, 8, 8, (25.0, 100.0)),
        ]
    for model in MODELS:
        parts += ["", f"## {model}: MB per step on each node's link against P (nodes of 8)", ""]
        parts.append(scaling_table(model, 8, worlds))
    text = "\n".join(parts) + "\n"
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bytes_vs_p.md"), "w") as f:
        f.write(text)
    plot(os.path.join(out_dir, "bytes_vs_p.png"), "GPT-2 124M", 8, [16, 32, 64, 128, 256, 512, 1024])
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=124_000_000, help="elements synchronized (default: GPT-2 small)")
    ap.add_argument("--worlds", default="2,4,8,16,32")
    ap.add_argument("--clusters", action="store_true", help="bytes per node and step time across nodes (above)")
    ap.add_argument("--out", default="benchmarks/results", help="where --clusters writes its table and plot")
    args = ap.parse_args()
    if args.clusters:
        print(clusters(args.out))
        return
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"Bytes sent per rank per synchronization of {args.numel:,} elements (× = fewer than fp32):\n")
    print(table(args.numel, worlds))


if __name__ == "__main__":
    main()
