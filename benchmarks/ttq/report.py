"""Tables, plot and JSON of :mod:`benchmarks.ttq.driver` from its runs (see there for how they are made
and :mod:`benchmarks.ttq.analysis` for the arithmetic)."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from benchmarks.ttq import analysis as ta
from benchmarks.harness.baselines import HOOKS

REFERENCE = "ddp_adamw"
#: an optimizer family whose best reachable loss is far from AdamW's (Lion at this batch size) also
#: gets its own target: the loss its DDP fp32 run reaches at 80 % of the run, so its members still
#: get a time to target and a "× DDP bf16" against DDP bf16 with the same optimizer
OWN_REFERENCE = {"lion": "ddp_lion"}
#: the "× DDP bf16" comparison of each optimizer family
BF16 = {"lion": "ddp_bf16_lion", "adamw": "ddp_bf16_adamw", "onebit_adam": "ddp_bf16_adamw",
        "onebit_lamb": "ddp_bf16_adamw", "turboquant": "ddp_bf16_adamw", "demo": "ddp_bf16_adamw"}
LABEL = {"ddp_adamw": "DDP fp32 + AdamW", "ddp_lion": "DDP fp32 + Lion", "ddp_bf16_adamw": "DDP bf16 + AdamW",
         "ddp_bf16_lion": "DDP bf16 + Lion", "ddp_powersgd_adamw": "DDP PowerSGD r4 + AdamW",
         "ddp_powersgd_lion": "DDP PowerSGD r4 + Lion", "ddp_fp16_adamw": "DDP fp16 + AdamW",
         "ddp_fp16_lion": "DDP fp16 + Lion", "lowbit_lion": "Lion Cub (auto)", "lowbit_lion_1bit": "Lion Cub 1-bit",
         "lowbit_lion_1bit_sync10": "Lion Cub 1-bit, momentum sync every 10",
         "lowbit_bitdp_adamw": "BitDP 2-bit + AdamW", "lowbit_bitdp_1bit_adamw": "BitDP 1-bit + AdamW",
         "lowbit_adam": "1-bit Adam", "lowbit_lamb": "1-bit LAMB", "lowbit_turboquant": "TurboQuant-Adam (auto)",
         "lowbit_diloco_fp32_h50": "DiLoCo fp32 H=50 + AdamW", "lowbit_diloco_int4_h50": "DiLoCo int4 H=50 + AdamW",
         "lowbit_diloco_sign_h50": "DiLoCo 1-bit H=50 + AdamW", "lowbit_diloco_int4_h150": "DiLoCo int4 H=150 + AdamW",
         "lowbit_diloco_int4_h10": "DiLoCo int4 H=10 + AdamW",
         "lowbit_diloco_stream_int4_h50": "Streaming DiLoCo int4 H=50 F=2 τ=1 + AdamW",
         "lowbit_diloco_sign_h10": "DiLoCo 1-bit H=10 (outer 0.7, 0.5) + AdamW",
         "lowbit_diloco_stream_int4_h10": "Streaming DiLoCo int4 H=10 F=2 τ=1 (outer 0.7, 0.5) + AdamW",
         "lowbit_diloco_stream_int4_h10_d4": "Streaming DiLoCo int4 H=10 F=2 τ=4 (outer 0.7, 0.5) + AdamW",
         "lowbit_demo_fp32_k32": "DeMo fp32 top-32", "lowbit_demo_sign_k32": "DeMo 1-bit top-32",
         "lowbit_demo_sign_k8": "DeMo 1-bit top-8", "lowbit_demo_sign_k8_d1": "DeMo 1-bit top-8, delay 1"}


def curve(rec: dict) -> list[tuple[float, float]]:
    """A run's validation curve (step, loss), smoothed (:func:`benchmarks.ttq.analysis.smooth`):
    what targets, crossings, losses at the budget and the plot read. The lr sweep reads the
    raw final loss."""
    return ta.smooth([(float(s), float(v)) for s, _, v in rec["evals"]])


def phase_bytes(rec: dict) -> dict[str, float]:
    """Cross-node wire bytes per step of each timed phase (max over nodes and directions)."""
    marks = sorted((int(k), v) for k, v in rec.get("counters", {}).items())
    out = {}
    for (a, before), (b, after) in zip(marks, marks[1:]):
        name = "warm-up" if b == rec["switch"] and rec["switch"] > ta.STARTUP else "main"
        out[name] = max(max(y[2] - x[2], y[3] - x[3]) for x, y in zip(before, after)) / (b - a)
    return out


def analyse(settings: dict, runs: dict) -> dict:
    """Per link: the target, the budget and one row per configuration (per-seed numbers kept)."""
    steps, out = settings["steps"], {"links": {}, "sweep": {}, "validation": []}
    for key, final in runs["sweep"].items():
        lrs = sorted(final)
        chosen = runs["chosen"][key]
        out["sweep"][key] = {"final_val": {f"{lr:g}": final[lr] for lr in lrs}, "chosen": chosen,
                             "centre": runs.get("centre", {}).get(key),
                             "at_edge": len(lrs) > 1 and chosen in (lrs[0], lrs[-1])}
    for link in settings["links"]:
        target = _target(REFERENCE, link, runs, steps)
        own = {f: _target(ref, link, runs, steps) for f, ref in OWN_REFERENCE.items() if ref in settings["configs"]}
        rows, cums = {}, {}
        for config in settings["configs"]:
            key = runs["keys"].get((config, link))
            timing = runs["timing"].get((config, link))
            seeds = {s: r for (lr, s), r in runs["quality"].get(key, {}).items() if lr == runs["chosen"].get(key)}
            if not timing or not seeds:
                rows[config] = {"missing": "timing run" if not timing else "quality runs"}
                continue
            switch = settings["switch"][config]
            pt = ta.phase_times(timing["step_s"], timing["switch"])
            cum = ta.cumulative_seconds(steps, switch, pt)
            cums[config] = cum
            per_seed = {}
            own_target = own.get(_opt(config, settings))
            for seed, rec in sorted(seeds.items()):
                per_seed[seed] = {**_to(curve(rec), target, cum, ""), "final_val": rec["evals"][-1][2],
                                  "plan": rec["plan"]}
                if own_target is not None:
                    per_seed[seed].update(_to(curve(rec), own_target, cum, "own_"))
            rows[config] = {"key": key, "lr": runs["chosen"][key], "switch": switch, "phase_times": pt,
                            "seconds_per_step": {n: v["mean"] for n, v in pt.items() if n != "startup"},
                            "wire_bytes_per_step": phase_bytes(timing), "projected_seconds": cum[-1],
                            "timing_plan": timing["plan"], "timing_code": timing.get("code"),
                            "topology": timing["topology"],
                            "timing_other_load": timing.get("other_load"), "per_seed": per_seed}
        budget = min(cums.values(), key=lambda c: c[-1])[-1] if cums else None
        for config, cum in cums.items():
            for seed, rec in runs["quality"][rows[config]["key"]].items():
                if rec["lr"] == rows[config]["lr"] and seed[1] in rows[config]["per_seed"]:
                    b = ta.step_at_seconds(cum, budget)
                    rows[config]["per_seed"][seed[1]]["loss_at_budget"] = ta.at_step(curve(rec), b)
        bounds = {"": _bound(runs, link, steps, rows, REFERENCE, "")}
        bounds.update({f: _bound(runs, link, steps, rows, OWN_REFERENCE[f], "own_") for f in own})
        out["links"][link] = {"target": target, "own_targets": own, "budget_s": budget, "rows": rows,
                              "bounds": {k: v for k, v in bounds.items() if v is not None}}
    for full in runs["full"]:
        out["validation"].append(validation(full, out["links"].get(full["link"], {}), runs, settings))
    return out


def _bound(runs: dict, link: str, steps: int, rows: dict, reference: str, prefix: str) -> dict | None:
    """The comm-free bound to a target on ``link``: ``reference``'s (DDP fp32's) steps to it in each
    seed, priced at the step time of its family's comm-free timing run (:data:`benchmarks.ttq.driver.BOUND`:
    the same computation, nothing on the wire). None without that run or the reference's rows."""
    from benchmarks.ttq.driver import BOUND

    timing = runs.get("bound", {}).get((BOUND.get(reference), link))
    seeds = rows.get(reference, {}).get("per_seed")
    if not timing or not seeds:
        return None
    pt = ta.phase_times(timing["step_s"], 0)
    cum = ta.cumulative_seconds(steps, 0, pt)
    per_seed = {}
    for seed, r in seeds.items():
        s_t = r.get(f"{prefix}steps_to_target")
        per_seed[seed] = {f"{prefix}steps_to_target": s_t,
                          f"{prefix}seconds_to_target": None if s_t is None else ta.seconds_at(cum, s_t)}
    return {"config": BOUND[reference], "reference": reference, "prefix": prefix, "per_seed": per_seed,
            "seconds_per_step": pt["main"]["mean"], "wire_bytes_per_step": phase_bytes(timing),
            "timing_code": timing.get("code")}


def of_bound(rows: dict, config: str, bound: dict | None) -> float | None:
    """``config``'s fraction of the comm-free bound: the bound's mean seconds to the target over
    ``config``'s (1.0: as fast as no communication at all), over the seeds both have; None where it
    misses the target in one of them."""
    if bound is None:
        return None
    field = f"{bound['prefix']}seconds_to_target"
    return _ratio({config: rows[config], "bound": bound}, config, "bound", field)


def _target(reference: str, link: str, runs: dict, steps: int) -> float | None:
    """The mean over seeds of ``reference``'s validation loss at 80 % of the run, at its chosen lr."""
    key = runs["keys"].get((reference, link))
    ref = [curve(r) for r in runs["quality"].get(key, {}).values() if r["lr"] == runs["chosen"].get(key)]
    try:
        return ta.target_loss(ref, steps) if ref else None
    except ValueError:
        return None


def _to(points: list[tuple[float, float]], target: float | None, cum: list[float], prefix: str) -> dict:
    """``{prefix}steps_to_target`` and ``{prefix}seconds_to_target`` of one quality curve."""
    s_t = ta.steps_to_target(points, target) if target is not None else None
    seconds = None if s_t is None else ta.seconds_at(cum, s_t)
    return {f"{prefix}steps_to_target": s_t, f"{prefix}seconds_to_target": seconds}


def validation(full: dict, link: dict, runs: dict, settings: dict) -> dict:
    """A full run on the link against the projection of its quality run (seed 0) and timing."""
    row = link.get("rows", {}).get(full["config"], {})
    target = link.get("target")
    measured_s = sum(full["step_s"])
    measured_t = None
    if target is not None and (s_t := ta.steps_to_target(curve(full), target)) is not None:
        measured_t = ta.at_step([(float(s), t) for s, t, _ in full["evals"]], s_t)
    proj = row.get("per_seed", {}).get(full["seed"], {})
    out = {"config": full["config"], "link": full["link"], "seed": full["seed"], "measured_seconds": measured_s,
           "projected_seconds": row.get("projected_seconds"), "measured_seconds_to_target": measured_t,
           "projected_seconds_to_target": proj.get("seconds_to_target"), "full_final_val": full["evals"][-1][2],
           "quality_final_val": proj.get("final_val"), "plan_full": full["plan"], "plan_quality": proj.get("plan"),
           "other_load": full.get("other_load"), "timing_other_load": row.get("timing_other_load")}
    # a projection from step times that other code (or another machine, since: a retime) measured says
    # nothing about this run's: shown, not compared
    out["same_code"] = full.get("code") == row.get("timing_code")
    for what in ("seconds", "seconds_to_target"):
        m, p = out[f"measured_{what}"], out[f"projected_{what}"]
        out[f"error_{what}"] = (p - m) / m if m and p is not None and out["same_code"] else None
    return out


def err(v: dict, what: str) -> str:
    """A validation row's projection error, or why there is none: the full run and the timing run
    it is projected from were made by other code (:func:`benchmarks.ttq.driver.code_fingerprint`)."""
    return _f(v[f"error_{what}"], "{:+.1%}") if v.get("same_code", True) else "timed by other code"


def _f(x, fmt="{:.1f}") -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def link_table(link: str, data: dict, settings: dict) -> str:
    rows, budget = data["rows"], data["budget_s"]
    lines = [f"### {link}\n\ntarget: validation loss **{_f(data['target'], '{:.4f}')}** (DDP fp32 + AdamW at "
             f"{int(0.8 * settings['steps'])} of {settings['steps']} steps, mean over seeds); budget for the loss "
             f"column: **{_f(budget)} s** (the fastest configuration's whole run; the others are read part-way "
             f"through their {settings['steps']}-step schedule, not as runs tuned to that budget).\n",
             f"| method | lr | steps to target | time to target (s) | × DDP bf16 | of bound | "
             f"loss at {_f(budget, '{:.0f}')} s | s/step (warm-up / main) | cross-node kB/step/node (warm-up / main) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    bound = data.get("bounds", {}).get("")
    for config, r in rows.items():
        if "missing" in r:
            lines.append(f"| {LABEL.get(config, config)} | – | missing: {r['missing']} |" + " – |" * 6)
            continue
        seeds = list(r["per_seed"].values())
        secs = [s["seconds_to_target"] for s in seeds]
        name = LABEL.get(config, config) + _seed_note(r, settings)
        ratio = _ratio(rows, config, BF16.get(_opt(config, settings), ""), "seconds_to_target")
        sps, wb = r["seconds_per_step"], r["wire_bytes_per_step"]
        lines.append(
            f"| {name} | {r['lr']:g} | "
            f"{ta.summary([s['steps_to_target'] for s in seeds], '{:.0f}')} | {ta.summary(secs)} | "
            f"{_f(ratio, '{:.2f}×')} | {_f(of_bound(rows, config, bound), '{:.2f}')} | "
            f"{ta.summary([s.get('loss_at_budget') for s in seeds], '{:.3f}')} | "
            f"{_f(sps.get('warm-up'), '{:.3f}')} / {_f(sps.get('main'), '{:.3f}')} | "
            f"{_f(_k(wb.get('warm-up')))} / {_f(_k(wb.get('main')))} |")
    if bound is not None:
        lines.append(_bound_row(bound, rows, BF16["adamw"], ""))
    for fam, own in data.get("own_targets", {}).items():
        lines += _own_table(fam, own, rows, settings, data.get("bounds", {}).get(fam))
    return "\n".join(lines) + "\n"


def _bound_row(bound: dict, rows: dict, bf16: str, prefix: str) -> str:
    """The table row of the comm-free bound: its steps are its reference's, its seconds those
    steps at the comm-free step time, nothing on the wire."""
    seeds = list(bound["per_seed"].values())
    ratio = _ratio({"bound": bound, bf16: rows.get(bf16, {})}, "bound", bf16, f"{prefix}seconds_to_target")
    name = f"**comm-free bound** ({LABEL.get(bound['reference'], bound['reference'])}'s steps, nothing sent)"
    head = (f"| {name} | " + ("– | " if not prefix else "") +
            f"{ta.summary([s[f'{prefix}steps_to_target'] for s in seeds], '{:.0f}')} | "
            f"{ta.summary([s[f'{prefix}seconds_to_target'] for s in seeds])} | {_f(ratio, '{:.2f}×')} | 1.00 |")
    if prefix:
        return head + " – |"
    return head + f" – | {_f(bound['seconds_per_step'], '{:.3f}')} | 0 |"


def _own_table(fam: str, own: float | None, rows: dict, settings: dict, bound: dict | None = None) -> list[str]:
    """The family's configurations against its own target (:data:`OWN_REFERENCE`), and its
    comm-free bound there."""
    members = [c for c, r in rows.items() if "per_seed" in r and _opt(c, settings) == fam]
    if own is None or not members:
        return []
    ref = OWN_REFERENCE[fam]
    lines = [f"\n{LABEL.get(ref, ref)}'s own target for the {fam.capitalize()} family: validation loss "
             f"**{own:.4f}** (at {int(0.8 * settings['steps'])} steps, mean over seeds):\n",
             f"| method | steps to target | time to target (s) | × {LABEL.get(BF16[fam], BF16[fam])} | "
             f"of bound | × {LABEL.get(ref, ref)} |", "|---|---:|---:|---:|---:|---:|"]
    for c in members:
        seeds = list(rows[c]["per_seed"].values())
        lines.append(f"| {LABEL.get(c, c)}{_seed_note(rows[c], settings)} | "
                     f"{ta.summary([s['own_steps_to_target'] for s in seeds], '{:.0f}')} | "
                     f"{ta.summary([s['own_seconds_to_target'] for s in seeds])} | "
                     f"{_f(_ratio(rows, c, BF16[fam], 'own_seconds_to_target'), '{:.2f}×')} | "
                     f"{_f(of_bound(rows, c, bound), '{:.2f}')} | "
                     f"{_f(_ratio(rows, c, ref, 'own_seconds_to_target'), '{:.2f}×')} |")
    if bound is not None:
        lines.append(_bound_row(bound, rows, BF16[fam], "own_"))
    return lines


def _ratio(rows: dict, config: str, ref: str, field: str) -> float | None:
    """``ref``'s mean seconds to the target over ``config``'s (above 1: ``config`` is faster), over
    the seeds both have (a missing seed run must not pair one method's seeds 0-2 with another's
    0-1); None where either misses the target in one of them, or ``config`` is ``ref``, or
    ``config`` met it at the first evaluation (no training time to compare: a curve too short or
    flat, as in the smoke tests, can start at or below the smoothed target)."""
    mine, theirs = rows[config].get("per_seed", {}), rows.get(ref, {}).get("per_seed", {})
    common = sorted(set(mine) & set(theirs))
    secs, ref_secs = [mine[k].get(field) for k in common], [theirs[k].get(field) for k in common]
    if config == ref or not common or None in secs + ref_secs:
        return None
    return _over(statistics.fmean(ref_secs), statistics.fmean(secs))  # type: ignore[arg-type]


def _over(a: float, b: float) -> float | None:
    """``a / b``; None where ``b`` is 0 (a target met at the first evaluation)."""
    return a / b if b else None


def _times_slower(a: float, b: float) -> str:
    """``a`` seconds against the fastest ``b``, in words: "1.25× slower", "as fast", or "met at
    the first evaluation" where ``b`` is 0."""
    if not b:
        return "the fastest met it at the first evaluation" if a else "both met at the first evaluation"
    return f"{a / b:.2f}× {'slower' if a > b else 'as fast'}"


def _seed_note(row: dict, settings: dict) -> str:
    """`` (2 of 3 seeds)`` where seed runs are missing (still running, or failed), else nothing."""
    have, want = len(row.get("per_seed", {})), len(settings["seeds"])
    return f" ({have} of {want} seeds)" if have < want else ""


def _k(b):
    return None if b is None else b / 1e3


def _opt(config: str, settings: dict) -> str:
    from benchmarks.e2e.worker import CONFIGS
    return CONFIGS[config][1]


def facts(result: dict, settings: dict) -> str:
    """Per link, plainly: the fastest method to the target and the best DDP bf16 baseline."""
    lines = []
    for link, data in result["links"].items():
        done = _reached(data["rows"], "seconds_to_target")
        if not done:
            lines.append(f"- {link}: no configuration reached the target in every seed.")
            continue
        best = min(done, key=lambda c: (done[c], c))
        bf16 = {c: t for c, t in done.items() if c.startswith("ddp_bf16_")}
        b16 = min(bf16, key=lambda c: (bf16[c], c)) if bf16 else None
        cmp = (f"; the best DDP bf16 ({LABEL[b16]}) {bf16[b16]:.1f} s: {_times_slower(bf16[b16], done[best])}"
               if b16 and b16 != best else
               "; that is DDP with bf16 communication" if b16 == best else "")
        missed = sorted(c for c, r in data["rows"].items() if c not in done and "per_seed" in r)
        absent = sorted(c for c, r in data["rows"].items() if "per_seed" not in r)
        short = sum(1 for r in data["rows"].values() if "per_seed" in r and _seed_note(r, settings))
        frac = of_bound(data["rows"], best, data.get("bounds", {}).get(""))
        cmp += f"; it runs at {frac:.2f} of the comm-free bound" if frac is not None else ""
        lines.append(f"- {link}: fastest to the target: {LABEL.get(best, best)}, {done[best]:.1f} s{cmp}. "
                     f"Not reaching it in every seed: {', '.join(LABEL.get(c, c) for c in missed) or 'none'}."
                     + (f" Not run yet: {', '.join(LABEL.get(c, c) for c in absent)}." if absent else "")
                     + (f" **Not final**: {short} configuration(s) still miss seeds." if short else ""))
        for fam, own in data.get("own_targets", {}).items():
            lines += _own_fact(link, fam, own, data["rows"], settings)
    return "\n".join(lines) + "\n"


def _reached(rows: dict, field: str) -> dict[str, float]:
    """Mean seconds to a target (``field`` of each seed) of the configurations that reach it in
    every seed."""
    return {c: statistics.fmean(s[field] for s in r["per_seed"].values()) for c, r in rows.items()
            if r.get("per_seed") and all(s.get(field) is not None for s in r["per_seed"].values())}


def _own_fact(link: str, fam: str, own: float | None, rows: dict, settings: dict) -> list[str]:
    """The family's fastest configuration to its own target, against DDP bf16 with its optimizer."""
    done = _reached({c: r for c, r in rows.items() if _opt(c, settings) == fam}, "own_seconds_to_target")
    if own is None or not done:
        return []
    best = min(done, key=lambda c: (done[c], c))
    b16 = BF16[fam]
    if b16 == best:
        cmp = "; that is DDP with bf16 communication"
    elif b16 in done:
        cmp = f"; {LABEL[b16]} {done[b16]:.1f} s: {_times_slower(done[b16], done[best])}"
    elif b16 in rows and "per_seed" in rows[b16]:
        cmp = f"; {LABEL[b16]} does not reach it in every seed"
    else:
        cmp = f"; {LABEL[b16]} was not run"
    return [f"- {link}, {fam.capitalize()} family to its own target ({own:.4f}): fastest {LABEL.get(best, best)}, "
            f"{done[best]:.1f} s{cmp}."]


def markdown(result: dict, settings: dict, command: str, machine: dict) -> str:
    m, mod = machine, settings["model"]
    params = next((r["params"] for r in result.get("_any", [])), None)
    made = ("a report of the recorded runs (each run's date and code are in its JSON under `runs/`)"
            if settings.get("report_only") else f"{settings.get('total_seconds', '?')} s in all")
    out = [f"# Time to quality: 2 emulated nodes x 2 ranks\n\n`{command}` — {settings.get('date', '')}, "
           f"{made}.\n\n",
           f"- machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} (gloo), one torch thread per rank\n",
           f"- model: examples/gpt_lion.py GPT d_model {mod['d_model']}, {mod['layers']} layers, {mod['heads']} heads, "
           f"seq {mod['seq']}{f', {params:,} parameters' if params else ''}; batch {mod['batch']} per rank; "
           f"{settings['steps']} steps, LR warm-up {settings['lr_warmup']} then cosine to 10 %; validation "
           f"every {settings['eval_every']} steps on {settings['val_batches']} held-out batches per rank\n",
           f"- seeds {settings['seeds']}; lr sweep x {settings['lr_factors']} of a centre on "
           f"{len(settings['swept'])} configurations (seed 0, final validation loss): DDP + AdamW and DDP + Lion "
           f"around the example's default ({settings['default_lr']}), every other configuration around its "
           "optimizer's default times the factor its reference (DDP + AdamW, or DDP + Lion for Lion) moved by; "
           f"extended by half or twice the best while it is the lowest or highest tried, up to "
           f"{settings.get('sweep_extend', 0)} times\n",
           (f"- learning rates fixed, not swept in these runs (an earlier sweep's choice, `--lr`): "
            f"{', '.join(f'{c} {lr:g}' for c, lr in settings['fixed_lr'].items())}\n"
            if settings.get("fixed_lr") else ""),
           "- baselines: " + "; ".join(f"{k}: {v}" for k, v in HOOKS.items() if k != "local") +
           f"; PowerSGD {settings['powersgd']}\n",
           f"- compression warm-ups (uncompressed steps): {settings['switch']}; they and every `auto` fallback "
           f"send {wires_said(settings.get('warmup_wire', 'fp32'))}\n",
           "- **comm-free bound**: DDP whose hook keeps each rank's gradient (the same computation, nothing on "
           "the wire; not a method), timed on each link; DDP fp32's steps to a target at its step time are the "
           "bound, and **of bound** is the bound's time over a method's (1.00: as fast as no communication)\n",
           "- **how**: quality runs on loopback (2 x 2 ranks, no shaping) give the validation loss per step; "
           "timing runs on each emulated link time every step of each phase (start-up steps one by one, then "
           "each phase's first step and the mean of the rest); the time to a loss is the projected training "
           "seconds of the steps before it. Evaluation is not in the seconds. Targets, crossings, the loss at "
           f"the budget and the plot read each validation curve averaged over {2 * ta.SMOOTH + 1} consecutive "
           "evaluations (centred), so that no crossing rests on one noisy evaluation; the lr sweep reads the "
           "raw final loss. Full runs on the links check "
           "the projection (below). **±** is the sample std over seeds, of the quality curves only: each "
           "configuration's step times come from one timing run per link, so run-to-run variation of the "
           "step time is not in it; the full runs show how far a real run lands from its projection.\n\n",
           "## Time to target\n\n"]
    out += [link_table(link, data, settings) + "\n" for link, data in result["links"].items()]
    out.append("## Verdict facts (computed)\n\n" + facts(result, settings))
    out.append("\n## Projection against full runs on the link\n\n")
    out.append("**other load**: share of the 2 cores busy with anything but this benchmark while the run ran "
               "(other jobs on this shared machine): a timing run under more load than the full run projects "
               "slower steps.\n\n" if result["validation"] else "")
    out.append("| config | link | training s measured | projected | "
               "error | time to target measured | projected | error | final val (full / quality run) | plans | "
               "other load (timing / full run) |\n|---|---|---:|---:|---:|---:|---:|---:|---|---|---|\n")
    for v in result["validation"]:
        out.append(f"| {v['config']} | {v['link']} | {_f(v['measured_seconds'])} | {_f(v['projected_seconds'])} | "
                   f"{err(v, 'seconds')} | {_f(v['measured_seconds_to_target'])} | "
                   f"{_f(v['projected_seconds_to_target'])} | {err(v, 'seconds_to_target')} | "
                   f"{_f(v['full_final_val'], '{:.4f}')} / {_f(v['quality_final_val'], '{:.4f}')} | "
                   f"{plan_check(v['config'], v['plan_full'], [v['plan_quality'] or []])} | "
                   f"{_f(v['timing_other_load'], '{:.0%}')} / {_f(v['other_load'], '{:.0%}')} |\n")
    out.append("\n## Learning-rate sweep (seed 0, final validation loss)\n\n| quality key | centre | " +
               "lr: final val | chosen |\n|---|---|---|---|\n")
    for key, s in result["sweep"].items():
        vals = ", ".join(f"{lr}: {v:.4f}" for lr, v in s["final_val"].items())
        centre = f"{s['centre']:g}" if s.get("centre") is not None else "–"
        fixed = key.split("@")[0] in settings.get("fixed_lr", {})
        note = " (fixed: --lr)" if fixed else " (at the sweep edge)" if s["at_edge"] else ""
        out.append(f"| {key} | {centre} | {vals} | {s['chosen']:g}{note} |\n")
    out.append("\n## Plans and topology (timing runs)\n\n")
    for link, data in result["links"].items():
        for config, r in data["rows"].items():
            if "missing" not in r:
                check = plan_check(config, r["timing_plan"], [s["plan"] for s in r["per_seed"].values()])
                flag = "" if check == "same" else f" — quality runs' plan: {check}"
                out.append(f"- {link} {config}: {r['topology']}; plan {r['timing_plan'] or '–'}{flag}\n")
    stale = sorted(f"{c}@{link}" for link, data in result["links"].items()
                   for c, r in [*data["rows"].items(), *((b["config"], b) for b in data.get("bounds", {}).values())]
                   if "missing" not in r and r.get("timing_code") != settings.get("code"))
    if stale:
        out.append(f"\n**Timed by other code** than this report's ({settings.get('code')}): {len(stale)} timing "
                   f"run(s), {', '.join(stale)}. Their step times may not be today's; "
                   "`python -m benchmarks.ttq --skip-existing --retime` times them again.\n")
    loaded = sorted(f"{c}@{link} ({r['timing_other_load']:.0%})" for link, data in result["links"].items()
                    for c, r in data["rows"].items() if (r.get("timing_other_load") or 0) > LOADED)
    if loaded:
        out.append(f"\n**Timed under other load** (over {LOADED:.0%} of the cores busy with other work): "
                   f"{', '.join(loaded)}. Their step times are slower than an idle machine's; delete those "
                   "timing runs and run the study again with `--skip-existing` on an idle machine.\n")
    return "".join(out)


#: a timing run made while more than this share of the cores did other work is flagged in the report
LOADED = 0.05


def plan_check(config: str, timing_plan: list[str], quality_plans: list[list[str]]) -> str:
    """Whether the quality runs trained with the plan the link's timing run resolved: ``same``,
    ``DIFFERS`` (a projection mixing two plans), or, for a configuration whose plan reads the
    link (:data:`benchmarks.ttq.driver.LINK_PLANNED`), ``unrecorded`` where a quality run kept no plan
    (made before the worker read the plans ahead of teardown)."""
    from benchmarks.ttq.driver import LINK_PLANNED

    if timing_plan and any(q and q != timing_plan for q in quality_plans):  # both recorded, and apart
        return "DIFFERS"
    if config in LINK_PLANNED and timing_plan and not all(quality_plans):
        return f"unrecorded in {sum(not q for q in quality_plans)} of {len(quality_plans)}"
    return "same"


def plot(result: dict, runs: dict, settings: dict, path: Path) -> None:
    """Validation loss (mean over seeds) against projected training seconds, one panel per link."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(result["links"])
    fig, axes = plt.subplots(1, len(links), figsize=(7 * len(links), 5), squeeze=False)
    colors = list(plt.get_cmap("tab20").colors)
    for ax, link in zip(axes[0], links):
        data = result["links"][link]
        tops = []
        for i, (config, r) in enumerate(data["rows"].items()):
            if "missing" in r:
                continue
            recs = [rec for (lr, s), rec in runs["quality"][r["key"]].items() if lr == r["lr"]]
            points = list(zip(*[curve(rec) for rec in recs]))
            cum = ta.cumulative_seconds(settings["steps"], r["switch"], r["phase_times"])
            xs = [ta.seconds_at(cum, p[0][0]) for p in points]
            ys = [statistics.fmean(v for _, v in p) for p in points]
            tops += [y for p, y in zip(points, ys) if p[0][0] >= 0.1 * settings["steps"]][:1]
            style = "--" if _opt(config, settings) == "lion" else "-"
            ax.plot(xs, ys, style, color=colors[i % len(colors)], label=LABEL.get(config, config), lw=1.4)
        if data["target"] is not None:
            ax.axhline(data["target"], color="k", lw=0.8, ls=":")
        if data["budget_s"]:
            ax.axvline(data["budget_s"], color="grey", lw=0.8, ls=":")
        ax.set(title=f"{link} between 2 nodes", xlabel="training seconds (projected)", ylabel="validation loss")
        if tops:  # from 10 % of the run on: the first steps' losses would flatten the rest
            ax.set_ylim(top=max(tops) + 0.02)
        ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7, title="dashed: Lion family", title_fontsize=7)
    fig.suptitle("Validation loss vs training wall-clock on the link (mean over seeds; dotted: target, budget)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def wires_said(text: str) -> str:
    """``--warmup-wire``'s value in words: ``fp32,lowbit_adam=bf16`` -> "`warmup_wire=fp32`, except
    lowbit_adam: `bf16`"."""
    from benchmarks.ttq.driver import split_wire

    default, exceptions = split_wire(text)
    said = f"`warmup_wire={default}`"
    return said + (", except " + ", ".join(f"{c}: `{w}`" for c, w in exceptions.items()) if exceptions else "")


def write(out: Path, settings: dict, command: str, machine: dict, runs: dict) -> dict:
    """``ttq.json`` (settings, results with per-seed numbers, run files), ``ttq.md``, ``ttq_loss.png``."""
    import time

    settings = {**settings, "date": settings.get("date") or time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    result = analyse(settings, runs)
    any_rec = [r for r in runs["timing"].values() if r]
    md = markdown({**result, "_any": any_rec}, settings, command, machine)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ttq.md").write_text(md)
    (out / "ttq.json").write_text(json.dumps({"command": command, "machine": machine, "settings": settings,
                                              "result": result}, indent=1, default=str) + "\n")
    if result["links"]:
        plot(result, runs, settings, out / "ttq_loss.png")
    return result
