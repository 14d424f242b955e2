"""The plan's verdict: one sentence naming the method to use, from :mod:`.predict`'s rows
(which may be "use DDP with bf16 communication")."""

from __future__ import annotations

from lowbit_strategy.plan.predict import Row

__all__ = ["NEAR_TIE", "RECOMMEND_MARGIN", "recommend"]

#: a low-bit method must beat DDP bf16 by this factor to be recommended over it
RECOMMEND_MARGIN = 1.05
#: rows this close to the fastest are named beside it (the model cannot tell them apart)
NEAR_TIE = 0.02


def recommend(rows: list[Row]) -> str:
    """One sentence: the fastest row (naming the rows within :data:`NEAR_TIE` of it), or DDP
    with bf16 communication when no low-bit row beats it by :data:`RECOMMEND_MARGIN`."""
    base = next(r for r in rows if r.key == "ddp_bf16")
    share = base.exposed_s / base.step_s
    fitting = [r for r in rows if r.fits is not False]
    if not fitting:
        return "No row fits the GPU's memory with fp32 weights and gradients: shard across more GPUs (--sharded)."
    best = min(fitting, key=lambda r: r.step_s)
    if (
        base.fits is False
        and best.form == "sharded"
        and (best.key == "hsdp_bf16" or best.step_s > 0.95 * min(r.step_s for r in fitting if r.key == "hsdp_bf16"))
    ):
        return (
            f"Use HSDP (FSDP2 inside each node, bf16 reduce across): DDP does not fit the GPU's memory, and no "
            f"sharded low-bit method is predicted to beat HSDP by {RECOMMEND_MARGIN - 1:.0%} or more."
        )
    if best.form == "world" and not any(r.form != "world" for r in fitting):
        return (
            f"Use {best.method} ({best.config}): only one FSDP group over every rank fits the GPU's memory "
            f"(predicted {best.step_s:.3g} s per step)."
        )
    if base.fits is not False and (best.key.startswith("ddp") or best.speedup < RECOMMEND_MARGIN):
        return (
            f"Use DDP with bf16 communication: its exposed communication is {share:.0%} of the step, so no "
            f"low-bit method is predicted to beat it by {RECOMMEND_MARGIN - 1:.0%} or more "
            f"(best: {best.method} {best.form}, {best.speedup:.2f}x)."
        )
    near = [f"{r.method} {r.form}" for r in fitting if r is not best and r.step_s <= best.step_s * (1 + NEAR_TIE)]
    ties = f"; within {NEAR_TIE:.0%} of it: {', '.join(near)}" if near else ""
    return (
        f"Use {best.method} ({best.form}; {best.config}): predicted {best.speedup:.2f}x DDP bf16's step "
        f"({best.step_s:.3g} s against {base.step_s:.3g} s, where DDP bf16 waits {share:.0%} of its step on the "
        f"network){ties}."
    )
