"""Markdown table and plot of :mod:`benchmarks.collectives.driver` results (pure formatting)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

ORDER = ("fp32", "fp16_hook", "powersgd_r1", "powersgd_r4", "lioncub_1bit", "summed_sign",
         "summed_lp4", "summed_lp8")
LINK_ORDER = ("1gbit", "100mbit", "unshaped")

NOTES = """\
How to read this (see `benchmarks/collectives/driver.py` and `benchmarks/collectives/worker.py`):

- **time**: median over the repetitions of the slowest rank's wall time for one
  synchronization, including encoding/decoding (sign bits, L1 quantization, PowerSGD's
  matrix products) — the codecs run on one CPU thread per rank, and P ranks share the cores.
- **wire**: bytes per rank on the emulated link, max over ranks and over the two directions,
  counted by the shaping qdiscs: Ethernet frames of ≤ 1500 B with their TCP/IP headers,
  and the TCP ACKs of the reverse flow; barrier traffic is subtracted.
  **iface** is the veth's own tx counter: it counts a GSO super-frame (up to 64 KiB) with
  one set of headers, so it is lower — except where tbf's bucket is smaller than such a
  frame (100mbit here) and tbf splits it into MTU frames before the veth counts them.
- **recorded**: bytes this rank sent as recorded by `lowbit_strategy.collectives.recording()`
  (the α–β payload of the algorithm, no headers).
- **model**: `lowbit_strategy.pricing.estimate(name, P, N, α, rate)`; α is measured as a
  4-byte allreduce's time / (2·⌈log2 P⌉). fp16_hook is priced as `bf16` (16 bits); PowerSGD,
  absent from the model, as the fp32 model applied to each of its three allreduces.
- **bound**: wire bytes / link rate: the least time the link needs for those bytes. The
  token bucket holds ~1 ms of traffic (≥ 16 KiB), so short transfers can beat it a little.
- PowerSGD is the math and communication of torch's `powerSGD_hook` (error feedback, warm
  start, uncompressed vectors in one fp32 allreduce, then one allreduce of all P factors and
  one of all Q factors) reimplemented with torch ops on a GPT-like set of shapes totalling N
  (`benchmarks/harness/powersgd.py`), since the hook itself needs a DDP GradBucket.
- No link delay: this kernel has no `sch_netem`, so links are rate-limited only (`tbf`).
"""


def _ms(x) -> str:
    return "–" if x is None else f"{x * 1e3:.1f}"


def _mb(x) -> str:
    return f"{x / 1e6:.3f}"


def _sorted(records: list[dict]) -> list[dict]:
    def key(r):
        link = LINK_ORDER.index(r["link"]) if r["link"] in LINK_ORDER else len(LINK_ORDER)
        algo = ORDER.index(r["algorithm"]) if r["algorithm"] in ORDER else len(ORDER)
        return (r["P"], link, r["link"], r["N"], algo)
    return sorted(records, key=key)


def _row(r: dict, fp32: dict | None) -> str:
    iface = max(x["if_tx"] for x in r["per_rank"])
    rec = r["recorded_bytes_per_rank"]
    ratio = "–" if r["measured_over_bound"] is None else f"{r['measured_over_bound']:.2f}"
    speedup = f"{fp32['median_s'] / r['median_s']:.1f}×" if fp32 else "–"
    over = f"{r['wire_bytes_per_rank'] / rec:.3f}" if rec else "–"
    return (f"| {r['P']} | {r['link']} | {r['N']:,} | {r['algorithm']} | {_ms(r['median_s'])} | {speedup} | "
            f"{_mb(r['wire_bytes_per_rank'])} | {_mb(iface)} | {_mb(rec)} | {over} | {_ms(r['model_s'])} | "
            f"{_ms(r['bound_s'])} | {ratio} |")


HEADER = ("| P | link | N | algorithm | time ms | vs fp32 | wire MB/rank | iface MB | recorded MB | "
          "wire/recorded | model ms | bound ms | measured/bound |\n"
          "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")


def _table(records: list[dict]) -> str:
    fp32 = {(r["P"], r["link"], r["N"]): r for r in records if r["algorithm"] == "fp32"}
    return HEADER + "\n".join(_row(r, fp32.get((r["P"], r["link"], r["N"]))) for r in _sorted(records)) + "\n"


def markdown(data: dict) -> str:
    """The whole report: machine, settings, headline (largest N) and full tables."""
    m, s, records = data["machine"], data["settings"], data["records"]
    top = max(r["N"] for r in records) if records else 0
    links = "\n".join(f"  - `{name}`: `tc qdisc ... root {q}` on both ends of every rank's link"
                      for name, q in s["links"].items())
    return (
        f"# Collective benchmark on an emulated network\n\n"
        f"`{data['command']}` — {data['date']}, {s['total_seconds']} s in all.\n\n"
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_mib']} MiB, Linux {m['kernel']}, "
        f"Python {m['python']}, torch {m['torch']} (gloo), one thread per rank\n"
        f"- P = {s['world_sizes']}, N = {[f'{n:,}' for n in s['sizes']]}, {s['reps']} timed repetitions "
        f"after {s['warmup']} warm-up, MTU {s['mtu']}\n- links (namespaces joined by a bridge, "
        f"`benchmarks/harness/netem.py`):\n{links}\n\n{NOTES}\n"
        f"## Headline: N = {top:,}\n\n{_table([r for r in records if r['N'] == top])}\n"
        f"## All results\n\n{_table(records)}"
    )


def plot(data: dict, path: Path) -> None:
    """Measured time (solid) and physical bound (dashed) vs N, one panel per (P, link)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = data["records"]
    ps = sorted({r["P"] for r in records})
    links = sorted({r["link"] for r in records},
                   key=lambda l: LINK_ORDER.index(l) if l in LINK_ORDER else len(LINK_ORDER))
    fig, axes = plt.subplots(len(ps), len(links), figsize=(5 * len(links), 4 * len(ps)), squeeze=False,
                             sharex=True)
    colors = dict(zip(ORDER, plt.get_cmap("tab10").colors))
    series: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        series[(r["P"], r["link"], r["algorithm"])].append(r)
    for i, p in enumerate(ps):
        for j, link in enumerate(links):
            ax = axes[i][j]
            for algo in ORDER:
                pts = sorted(series.get((p, link, algo), []), key=lambda r: r["N"])
                if not pts:
                    continue
                ns = [r["N"] for r in pts]
                ax.plot(ns, [r["median_s"] * 1e3 for r in pts], "o-", color=colors[algo], label=algo)
                if all(r["bound_s"] for r in pts):
                    ax.plot(ns, [r["bound_s"] * 1e3 for r in pts], "--", color=colors[algo], alpha=0.6)
            ax.set(xscale="log", yscale="log", title=f"P={p}, {link}", xlabel="N (float32 values)",
                   ylabel="ms per synchronization")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=8, title="solid: measured\ndashed: wire bytes / rate", title_fontsize=8)
    fig.suptitle("One synchronization on an emulated network (gloo, namespaces + tbf)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
