"""Compute/communication split, markdown tables and plots of :mod:`benchmarks.e2e.driver` results."""
from __future__ import annotations

import re
from pathlib import Path

ORDER = ("ddp_lion", "ddp_adamw", "ddp_bf16_lion", "ddp_bf16_adamw", "ddp_fp16_lion", "ddp_fp16_adamw",
         "ddp_powersgd_lion", "ddp_powersgd_adamw", "lowbit_lion", "lowbit_lion_1bit",
         "lowbit_lion_4bit", "lowbit_lion_8bit", "lowbit_lion_fp32", "lowbit_bitdp_adamw",
         "lowbit_bitdp_1bit_adamw", "calib_lion", "calib_adamw")
LINK_ORDER = ("1gbit", "100mbit", "unshaped")
BASELINE = "ddp_lion"

NOTES = """\
How to read this (see `benchmarks/e2e/driver.py` and `benchmarks/e2e/worker.py`):

- Each row is **one** training run of P processes, each in its own network namespace
  (`benchmarks/harness/netem.py`), started by the harness with env:// variables; Lightning sees
  `LOCAL_RANK` and uses those processes (its `LightningEnvironment` reports
  `creates_processes_externally`), with `devices=P, num_nodes=1`, gloo over the shaped veth.
  Same seed, same initial weights, same data order (Lightning's `DistributedSampler`) in
  every run. Training runs until the **wall-clock budget** is spent: rank 0 broadcasts a
  4-byte stop flag after every step (in every configuration, calibration included).
- **step ms**: steady-state wall time per step on rank 0 (the ranks run in lock-step):
  the time from the end of step `warm` to the last step, divided by the steps in between
  (DDP's bucket rebuild and PowerSGD's fp32 warm-up are before the window). Data loading,
  forward, backward, synchronization, optimizer step and callbacks are all in it.
- **compute / comm**:
  - `recorded` (lowbit strategies): comm = the seconds their blocking collectives took
    (the traffic logs `CommStats` reads; waiting for the slowest rank included), mean over
    ranks; compute = step − comm, so it includes the codec (quantize, pack, unpack) and
    the Lion update;
  - `calibrated` (DDP and comm hooks — fp16, PowerSGD, BitDP — whose communication overlaps
    the backward pass; BitDP's recorded seconds are launch-to-completion times of transfers that
    overlap each other and the backward pass, so they are not a share of the step):
    compute = step time of the calibration run with the same optimizer (`calib_*`: a DDP comm
    hook returns each rank's own bucket, `lowbit_strategy.keep_local_gradients`,
    so no gradient crosses the wire), comm = step − compute (the part of the
    communication that overlap did not hide, plus the hook's own encode/decode; clipped at 0);
  - **calib compute** of the same optimizer and **step − calib** (the calibrated estimate
    of communication) are shown for every row, so both methods can be compared. The two
    disagree for the lowbit rows, and not only by the codec's cost: with P ranks on fewer
    cores, a rank blocked in a collective is also waiting for ranks that the scheduler has
    not run yet, so `recorded` comm includes CPU-contention wait and `recorded` compute is
    less than the calibration's (where all P ranks compute at once); step − calib can be
    slightly negative for the same reason (and run-to-run noise of a few %).
- **of bound**: calib compute ÷ step ms — the fraction of the comm-free bound (the same
  optimizer's calibration run, where no gradient crosses the wire) this configuration reaches.
- **CPU ms/step**: CPU seconds per step of every thread of every rank (gloo's included),
  summed over the P ranks (`getrusage`), in the steady-state window. Divided by the machine's
  cores it is the step time of a run that is purely CPU-bound: where step ms is close to
  that, the codecs and the collectives' CPU work, not the link, set the pace.
- **wire kB/step**: bytes per step on the emulated link in the steady-state window, max over
  ranks and directions, from the shaping qdiscs' counters (Ethernet frames with TCP/IP
  headers and ACKs; 1 kB = 1000 B). **payload kB/step** is what the lowbit
  strategies recorded as sent (no headers), in the same window, max over ranks.
- **loss reached**: training loss of the last 20 steps, mean over steps and ranks.
  **val loss**: held-out batches (last 10 % of the data), the same ones in every run.
- **speed-up**: step time of DDP + Lion (fp32 allreduce) on the same link / this step time.
  **× DDP bf16**: step time of DDP with torch's `bf16_compress_hook` and the same optimizer
  family (AdamW for 1-bit Adam/LAMB and TurboQuant) / this step time.
  Wire ×: DDP + Lion's wire bytes per step / this configuration's. For a calibration row the
  speed-up is the bound with no communication at all.
- Headline **loss @ equal step**: rank 0's training loss around the step both runs of the
  comparison reached (mean of the logged points within ±10 steps of min(steps) − 10),
  which separates per-step quality from speed.
- **other load**: share of the machine's cores kept busy by anything but this benchmark's
  processes during the run (/proc/stat busy time minus the benchmark's own CPU time). It
  includes interrupt/softirq time, where the kernel also processes this benchmark's own
  packets (veth, bridge, tbf), but mostly other people's jobs on this shared machine
  (test suites, ~25 % of the cores even during calibration runs that send nothing): they
  slow compute down and add run-to-run noise.
- Calibration runs once per (P, link), right before that link's configurations, and each row
  uses the calibration of its own link: the two calibrations of a P (their links differ only
  by a 4-byte flag per step) show how much step times vary from run to run.
- The loss plot shows rank 0's training loss, logged every 2 steps and smoothed by a centered
  moving average of 11 points (±10 steps), against seconds since training started (process start-up and DDP setup not included).
- CPU contention: P ranks share this machine's cores (one torch thread each, plus gloo's
  threads). With P = 4 on 2 cores each rank gets about half a core, so compute is ~2× what
  one rank alone would need, and any CPU work of the communication (gloo reductions,
  codecs) competes with the other ranks' compute. The network is emulated by `tbf` only
  (this kernel has no `sch_netem`, so no link delay), and one "step" is small (batch 8 ×
  64 tokens per rank) so the model's gradient is large relative to its compute: the
  regime in which a slow link dominates.
"""


def _key(r: dict):
    link = LINK_ORDER.index(r["link"]) if r["link"] in LINK_ORDER else len(LINK_ORDER)
    cfg = ORDER.index(r["config"]) if r["config"] in ORDER else len(ORDER)
    return (r["P"], link, r["link"], cfg)


#: optimizers without a calibration run of their own: their comm-free bound is AdamW's (the
#: same model and data; 1-bit Adam's compression stage costs less than AdamW per step, 1-bit
#: LAMB's slightly more: two norms per parameter)
CALIBRATION_OF = {"onebit_adam": "adamw", "onebit_lamb": "adamw", "turboquant": "adamw"}


def annotate(data: dict) -> dict:
    """Add compute/comm split, speed-up and wire ratio to every finished record (in place)."""
    ok = [r for r in data["records"] if not r.get("failed")]
    calib = {(r["P"], r["optimizer"]): r for r in ok if r["config"].startswith("calib_")}
    calib.update({(r["P"], r["link"], r["optimizer"]): r for r in ok if r["config"].startswith("calib_")})
    base = {(r["P"], r["link"]): r for r in ok if r["config"] == BASELINE}
    bf16 = {(r["P"], r["link"], r["optimizer"]): r for r in ok if r["config"].startswith("ddp_bf16_")}
    for r in ok:
        opt = CALIBRATION_OF.get(r["optimizer"], r["optimizer"])
        c = calib.get((r["P"], r["link"], opt), calib.get((r["P"], opt)))
        r["calib_compute_s"] = c["step_s"] if c else None
        if r["config"].startswith("calib_"):
            r.update(compute_s=r["step_s"], comm_s=0.0, split="calibration")
        elif r["config"].startswith("lowbit_lion"):  # blocking collectives inside optimizer.step()
            r.update(comm_s=r["comm_s_recorded"], compute_s=r["step_s"] - r["comm_s_recorded"], split="recorded")
        elif c:
            comm = max(0.0, r["step_s"] - c["step_s"])
            r.update(comm_s=comm, compute_s=r["step_s"] - comm, split="calibrated")
        else:
            r.update(comm_s=None, compute_s=None, split="n/a (no calibration run)")
        r["step_minus_calib_s"] = r["step_s"] - c["step_s"] if c else None
        b = base.get((r["P"], r["link"]))
        r["speedup_vs_ddp_lion"] = b["step_s"] / r["step_s"] if b else None
        # "× DDP bf16": against DDP with bf16 communication and the same optimizer family
        h = bf16.get((r["P"], r["link"], opt))
        r["speedup_vs_ddp_bf16"] = h["step_s"] / r["step_s"] if h and not r["config"].startswith("calib_") else None
        r["wire_x_vs_ddp_lion"] = (b["wire_bytes_per_step"] / r["wire_bytes_per_step"]
                                   if b and r["wire_bytes_per_step"] and r["split"] != "calibration" else None)
    return data


def cell(x, scale=1.0, fmt="{:.1f}") -> str:
    return "–" if x is None else fmt.format(x * scale)


HEADER = ("| config | optimizer | steps | step ms | of bound | compute ms | comm ms | split | calib compute ms | "
          "step − calib ms | CPU ms/step | wire kB/step | payload kB/step | wire × | loss reached | val loss | "
          "speed-up | × DDP bf16 | other load |\n"
          "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")


def _row(r: dict) -> str:
    if r.get("failed"):
        return f"| {r['config']} | – | FAILED{' (timed out)' if r.get('timed_out') else ''} |" + " – |" * 16
    name = r["config"] + (f" ({', '.join(plan_text(x) for x in r['plan'])})" if r.get("plan") else "")
    if r["config"].startswith("calib_"):
        name += f" ({r['link']})"
    bound = r["calib_compute_s"] / r["step_s"] if r["calib_compute_s"] else None
    return (f"| {name} | {r['optimizer']} | {r['steps']} | {cell(r['step_s'], 1e3)} | {cell(bound, fmt='{:.2f}')} | "
            f"{cell(r['compute_s'], 1e3)} | "
            f"{cell(r['comm_s'], 1e3)} | {r['split']} | {cell(r['calib_compute_s'], 1e3)} | "
            f"{cell(r['step_minus_calib_s'], 1e3)} | {cell(r.get('cpu_s_per_step'), 1e3, '{:.0f}')} | "
            f"{cell(r['wire_bytes_per_step'], 1e-3)} | {cell(r['recorded_bytes_per_step'] or None, 1e-3)} | "
            f"{cell(r['wire_x_vs_ddp_lion'], fmt='{:.1f}×')} | {r['loss_reached']:.3f} | {r['val_loss']:.3f} | "
            f"{cell(r['speedup_vs_ddp_lion'], fmt='{:.2f}×')} | {cell(r.get('speedup_vs_ddp_bf16'), fmt='{:.2f}×')} | "
            f"{cell(r.get('other_load'), 100, '{:.0f} %')} |")


def plan_text(text: str) -> str:
    """``Plan(mode='lp', bits=8, levels=31)`` -> ``lp, 8-bit lanes, 31 levels``."""
    m = re.fullmatch(r"Plan\(mode='(\w+)', bits=(\d+), levels=(\d+)\)", text)
    if not m:
        return text
    mode, bits, levels = m.groups()
    return f"{mode}, {bits}-bit" + (f" lanes, {levels} levels" if mode == "lp" else "")


def _headline(records: list[dict]) -> str:
    rows = []
    for (p, link) in sorted({(r["P"], r["link"]) for r in records}, key=lambda k: _key({"P": k[0], "link": k[1],
                                                                                         "config": ""})):
        got = {r["config"]: r for r in records if r["P"] == p and r["link"] == link and not r.get("failed")}
        b = got.get(BASELINE)
        for name in ("lowbit_lion", "lowbit_lion_1bit", "lowbit_lion_4bit", "ddp_bf16_lion", "ddp_bf16_adamw",
                     "ddp_fp16_adamw", "ddp_powersgd_lion", "ddp_powersgd_adamw", "lowbit_bitdp_adamw",
                     "lowbit_bitdp_1bit_adamw", "lowbit_adam", "lowbit_lamb", "lowbit_turboquant"):
            r = got.get(name)
            if r and b:
                at = max(1, min(r["steps"], b["steps"]) - 10)
                rows.append(f"| {p} | {link} | {name} vs {BASELINE} | {b['step_s'] / r['step_s']:.2f}× | "
                            f"{cell(r.get('speedup_vs_ddp_bf16'), fmt='{:.2f}×')} | "
                            f"{b['wire_bytes_per_step'] / r['wire_bytes_per_step']:.1f}× | "
                            f"{r['steps']} vs {b['steps']} | {r['loss_reached']:.3f} vs {b['loss_reached']:.3f} | "
                            f"{r['val_loss']:.3f} vs {b['val_loss']:.3f} | "
                            f"{cell(_loss_at(r, at), fmt='{:.3f}')} vs {cell(_loss_at(b, at), fmt='{:.3f}')} (step {at}) |")
    return ("| P | link | comparison | step-time speed-up | × DDP bf16 (same optimizer) | wire bytes ÷ | "
            "steps in budget | loss reached | val loss | loss @ equal step |\n"
            "|---|---|---|---:|---:|---:|---|---|---|---|\n" + "\n".join(rows) + "\n")


def _loss_at(r: dict, step: int, half: int = 10) -> float | None:
    near = [loss for _, s, loss in r["curve"] if abs(s - step) <= half]
    return sum(near) / len(near) if near else None


def _noise(records: list[dict]) -> str:
    """Run-to-run spread visible in the data: same plan run twice, calibration per link."""
    ok = [r for r in records if not r.get("failed")]
    lines = []
    for r in ok:
        twin = next((t for t in ok if t["config"] == "lowbit_lion_8bit" and t["P"] == r["P"]
                     and t["link"] == r["link"]), None)
        if r["config"] == "lowbit_lion" and twin and r.get("plan") == twin.get("plan"):
            lines.append(f"- P={r['P']} {r['link']}: `lowbit_lion` resolved to the same plan as `lowbit_lion_8bit` "
                         f"({', '.join(plan_text(x) for x in r['plan'])}): {r['step_s'] * 1e3:.0f} vs "
                         f"{twin['step_s'] * 1e3:.0f} ms/step (other load {r.get('other_load', 0):.0%} vs "
                         f"{twin.get('other_load', 0):.0%}).")
    for p in sorted({r["P"] for r in ok}):
        for opt in ("lion", "adamw"):
            cal = [r for r in ok if r["P"] == p and r["config"] == f"calib_{opt}"]
            if len(cal) > 1:
                lines.append(f"- P={p} `calib_{opt}` on the links' two runs: " + " vs ".join(
                    f"{r['step_s'] * 1e3:.0f} ms/step ({r['link']}, other load {r.get('other_load', 0):.0%})"
                    for r in cal) + ".")
    if not lines:
        return ""
    return ("\n**Run-to-run noise** (one run per configuration; read differences below ~20 % as noise):\n\n"
            + "\n".join(lines) + "\n")


def _hook_check(records: list[dict]) -> str:
    lines = []
    for r in sorted((r for r in records if not r.get("failed") and r.get("hook_calls_per_step")), key=_key):
        lines.append(f"- P={r['P']} {r['link']} {r['config']}: {r['hook_calls_per_step']:.2f} hook calls per step "
                     f"(one per DDP bucket), {r['wire_bytes_per_step'] / 1e3:.1f} kB/step on the wire")
    return "\n".join(lines) + "\n" if lines else "- (no hooked configuration ran)\n"


def markdown(data: dict) -> str:
    m, s, records = data["machine"], data["settings"], data["records"]
    mod = s["model"]
    params = next((r["params"] for r in records if r.get("params")), None)
    links = "\n".join(f"  - `{name}`: `tc qdisc ... root {q}` on both ends of every rank's link"
                      for name, q in s["links"].items())
    skipped = (f"- not run (strategy not registered after `import lowbit_strategy`): "
               f"{', '.join(s['skipped_unregistered'])}\n" if s.get("skipped_unregistered") else "")
    out = [
        "# End-to-end training on an emulated network\n\n",
        f"`{data['command']}` — {data['date']}, {s.get('total_seconds', '?')} s in all.\n\n",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['memory_mib']} MiB, Linux {m['kernel']}, Python "
        f"{m['python']}, torch {m['torch']} (gloo), one torch thread per rank\n",
        f"- P = {s['world_sizes']} ranks on {m['cores']} cores; one run per (P, link, configuration), "
        f"{s['budget_s']:g} s of training each; steady-state window after step {s['warm_steps']}\n",
        f"- model: `examples/gpt_lion.py` GPT, d_model {mod['d_model']}, {mod['layers']} layers, {mod['heads']} heads, "
        f"seq {mod['seq']}, byte vocabulary, tied embeddings"
        f"{f', {params:,} parameters ({4 * params / 1e6:.2f} MB of fp32 gradient)' if params else ''}; "
        f"batch {mod['batch']} per rank; data: {mod['data_mb']:g} MB of the stdlib's source, seed {mod['seed']}\n",
        "- optimizers: Lion lr 1e-3, betas (0.9, 0.99), wd 0.1; AdamW lr 3e-3, wd 0.1 (the example's defaults); "
        "20 warm-up steps, cosine over 2000 steps (the same step schedule in every run)\n",
        f"- PowerSGD: torch's `powerSGD_hook`, {s['powersgd']}, error feedback and warm start on; "
        "bf16: torch's `bf16_compress_hook`; fp16: torch's `fp16_compress_hook`; all registered by "
        "`benchmarks.harness.baselines.HookedDDP`, since Lightning's DDPStrategy registers comm hooks on CUDA only "
        "(and DDP refuses `bf16_compress_hook` by name outside NCCL)\n",
        f"- links (namespaces joined by a bridge, `benchmarks/harness/netem.py`):\n{links}\n", skipped, "\n", NOTES,
        "\n## Headline\n\n", _headline(records), _noise(records),
    ]
    for (p, link) in sorted({(r["P"], r["link"]) for r in records if not r["config"].startswith("calib_")},
                            key=lambda k: _key({"P": k[0], "link": k[1], "config": ""})):
        rows = sorted((r for r in records if r["P"] == p and r["link"] == link and
                       not r["config"].startswith("calib_")), key=_key)
        out.append(f"\n## P = {p}, {link}\n\n{HEADER}" + "\n".join(_row(r) for r in rows) + "\n")
    cal = sorted((r for r in records if r["config"].startswith("calib_")), key=_key)
    if cal:
        out.append("\n## Calibration (no gradient synchronization; compute time)\n\n" + HEADER +
                   "\n".join(_row(r) for r in cal) + "\n")
    out.append("\n## Comm hooks really ran\n\n" + _hook_check(records))
    failed = [r for r in records if r.get("failed")]
    for r in failed:
        tail = "\n".join(f"rank {k}: ...{v[-800:]}" for k, v in r["error"].items())
        out.append(f"\n### FAILED: P={r['P']} {r['link']} {r['config']}\n\n```\n{tail}\n```\n")
    return "".join(out)


def _panels(records: list[dict]):
    keys = sorted({(r["P"], r["link"]) for r in records if not r.get("failed") and
                   not r["config"].startswith("calib_")}, key=lambda k: _key({"P": k[0], "link": k[1], "config": ""}))
    ps = sorted({k[0] for k in keys})
    links = sorted({k[1] for k in keys}, key=lambda l: LINK_ORDER.index(l) if l in LINK_ORDER else 9)
    return ps, links


def _smooth(values: list[float], half: int = 5) -> list[float]:
    """Centered moving average over 2·half + 1 points (fewer at the ends): no lag."""
    return [sum(values[max(0, i - half): i + half + 1]) / len(values[max(0, i - half): i + half + 1])
            for i in range(len(values))]


def plot_loss(data: dict, path: Path) -> None:
    """Training loss (rank 0, centered moving average) vs wall seconds, one panel per (P, link)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in data["records"] if not r.get("failed")]
    ps, links = _panels(records)
    if not ps:
        return
    fig, axes = plt.subplots(len(ps), len(links), figsize=(6.5 * len(links), 4.5 * len(ps)), squeeze=False,
                             sharey=True)
    colors = dict(zip(ORDER, list(plt.get_cmap("tab10").colors) + ["#000000", "#aa7700", "#555555"]))
    for i, p in enumerate(ps):
        for j, link in enumerate(links):
            ax = axes[i][j]
            for r in sorted((r for r in records if r["P"] == p and r["link"] == link
                             and not r["config"].startswith("calib_")), key=_key):
                wall, _, loss = zip(*r["curve"])
                style = "--" if r["optimizer"] == "adamw" else "-"
                ax.plot(wall, _smooth(list(loss)), style, color=colors.get(r["config"]), label=r["config"], lw=1.4)
            ax.set(title=f"P={p}, {link}", xlabel="wall seconds since training start", ylabel="training loss")
            ax.set_ylim(top=4.5)
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=8, title="solid: Lion, dashed: AdamW", title_fontsize=8)
    fig.suptitle("GPT training loss vs wall time on an emulated network (rank 0, moving average of 11 points)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_split(data: dict, path: Path) -> None:
    """Stacked compute / comm ms per step per configuration, one panel per (P, link)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in data["records"] if not r.get("failed") and r.get("compute_s") is not None]
    ps, links = _panels(records)
    if not ps:
        return
    fig, axes = plt.subplots(len(ps), len(links), figsize=(6.5 * len(links), 0.5 + 4.5 * len(ps)), squeeze=False)
    for i, p in enumerate(ps):
        for j, link in enumerate(links):
            ax = axes[i][j]
            rows = sorted((r for r in records if r["P"] == p and r["link"] == link
                           and not r["config"].startswith("calib_")), key=_key)[::-1]
            names = [r["config"] for r in rows]
            comp = [r["compute_s"] * 1e3 for r in rows]
            comm = [r["comm_s"] * 1e3 for r in rows]
            ax.barh(names, comp, color="#4c72b0", label="compute (incl. codec)")
            ax.barh(names, comm, left=comp, color="#dd8452", label="communication")
            for y, r in enumerate(rows):
                ax.text(r["step_s"] * 1e3, y, f" {r['step_s'] * 1e3:.0f}", va="center", fontsize=7)
            ax.set(title=f"P={p}, {link}", xlabel="ms per step")
            ax.grid(True, axis="x", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=2)
    fig.suptitle("Step time split: compute vs communication (see e2e.md for the method)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
