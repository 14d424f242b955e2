"""The plan's verdict: one sentence naming the method to use, from :mod:`.predict`'s rows
(which may be "use DDP with bf16 communication"), ranked by the whole run's time when
``--steps`` priced it (:mod:`.warmup`), else by the steady-state step. Where the fastest row
is one whose effect on the loss the plan cannot price and a measurement found a cost
(:data:`QUALITY_CAVEATS`), the choice is made without it (which may be DDP bf16) and the
sentence names it after, with its caveat."""

from __future__ import annotations

from lowbit_strategy.plan.predict import Row
from lowbit_strategy.plan.warmup import WARMUP_KEYS

__all__ = ["NEAR_TIE", "QUALITY_CAVEATS", "RECOMMEND_MARGIN", "recommend"]

#: a low-bit method must beat DDP bf16 by this factor to be recommended over it
RECOMMEND_MARGIN = 1.05
#: rows this close to the fastest are named beside it (the model cannot tell them apart)
NEAR_TIE = 0.02
#: row key prefixes whose cost in loss the plan does not price, with what was measured of it
#: (this package's time-to-quality benchmark: GPT, 4M parameters, 1,500 steps, 3 seeds)
QUALITY_CAVEATS = {
    "powersgd": "PowerSGD's effect on the loss is not priced (it needed 8% more steps than DDP to the same "
    "loss in this package's time-to-quality benchmark)",
    "diloco": "DiLoCo's effect on the loss is not priced (local updates: published small-scale costs are "
    "+0.7% loss at 2 workers and +2% at 4 for the same tokens, 'Scaling laws for DiLoCo', 2025; in this package's "
    "time-to-quality benchmark, 1,500 steps at 2 workers, +4.7% at H=10 with outer momentum 0.5, +20% with 0.9)",
    "demo": "DeMo's effect on the loss is not priced (decoupled momentum: the DisTrO report's 1.2B run ended at "
    "loss 2.449 against AdamW-DDP's 2.373; this package's time-to-quality rows for it are in progress)",
    "lion_1bit": "Lion Cub 1-bit's effect on the loss is not priced (it never reached DDP + Lion's loss at 80% "
    "of the run in this package's time-to-quality benchmark, where the 8-bit lanes did)",
}


def _caveat(row: Row) -> str | None:
    return next((text for key, text in QUALITY_CAVEATS.items() if row.key.startswith(key)), None)


def recommend(rows: list[Row]) -> str:
    """One sentence: the fastest row (naming the rows within :data:`NEAR_TIE` of it), or DDP
    with bf16 communication when no low-bit row beats it by :data:`RECOMMEND_MARGIN` (HSDP when
    DDP does not fit the GPU). Rows with a :data:`QUALITY_CAVEATS` entry are left out of that
    choice and of the ties; when one of them is the fastest of all, it is named after the choice,
    with its caveat. Ties in time keep the rows' order (:func:`min` takes the first)."""
    fitting = [r for r in rows if r.fits is not False]
    if not fitting:
        return "No row fits the GPU's memory with fp32 weights and gradients: shard across more GPUs (--sharded)."
    fastest = min(fitting, key=lambda r: r.time_s)
    caveat = _caveat(fastest)
    sentence, chosen = _choice(rows, [r for r in fitting if not _caveat(r)] or fitting)
    if caveat and chosen is not fastest:
        sentence += f" {fastest.method} ({fastest.form}) is predicted faster ({fastest.speedup:.2f}x), but {caveat}."
    elif caveat:
        sentence += f" {caveat[0].upper()}{caveat[1:]}."
    return sentence


def _choice(rows: list[Row], candidates: list[Row]) -> tuple[str, Row | None]:
    """The sentence for the fastest of ``candidates`` (rows that fit, without a caveat where any),
    and the row it recommends (None: DDP bf16 or HSDP)."""
    base = next(r for r in rows if r.key == "ddp_bf16")
    share = base.exposed_s / base.step_s
    best = min(candidates, key=lambda r: r.time_s)
    hsdp = next((r for r in candidates if r.key == "hsdp_bf16"), None)
    if base.fits is False and hsdp is not None and (best is hsdp or best.time_s * RECOMMEND_MARGIN > hsdp.time_s):
        return (
            f"Use HSDP (FSDP2 inside each node, bf16 reduce across): DDP does not fit the GPU's memory, and no "
            f"low-bit method is predicted to beat HSDP by {RECOMMEND_MARGIN - 1:.0%} or more."
        ), None
    if best.form == "world" and not any(r.form != "world" for r in candidates):
        return (
            f"Use {best.method} ({best.config}): only one FSDP group over every rank fits the GPU's memory "
            f"(predicted {best.step_s:.3g} s per step)."
        ), best
    if base.fits is not False and (best.key.startswith("ddp") or best.speedup < RECOMMEND_MARGIN):
        return (
            f"Use DDP with bf16 communication: its exposed communication is {share:.0%} of the step, so no "
            f"low-bit method is predicted to beat it by {RECOMMEND_MARGIN - 1:.0%} or more "
            f"(best: {best.method} {best.form}, {best.speedup:.2f}x)."
        ), None
    near = [f"{r.method} {r.form}" for r in candidates if r is not best and r.time_s <= best.time_s * (1 + NEAR_TIE)]
    ties = f"; within {NEAR_TIE:.0%} of it: {', '.join(near)}" if near else ""
    if best.run_s is None:
        what = "step"
    else:
        what = "time for the run" + (f", its {best.warmup_steps:,} warm-up steps included" if best.warmup_steps else "")
    sentence = (
        f"Use {best.method} ({best.form}; {best.config}): predicted {best.speedup:.2f}x DDP bf16's {what} "
        f"({_seconds(best.time_s)} against {_seconds(base.time_s)}, where DDP bf16 waits {share:.0%} of its step "
        f"on the network){ties}."
    )
    if best.run_s is None and best.key.startswith(WARMUP_KEYS):
        sentence += " Its uncompressed warm-up (warmup_wire) is not priced: --steps prices a whole run."
    return sentence, best


def _seconds(s: float) -> str:
    return f"{s:,.0f} s" if s >= 100 else f"{s:.3g} s"
