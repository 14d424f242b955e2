"""The arithmetic of :mod:`benchmarks.ttq.driver`, pure and tested on synthetic curves.

* **Phases** (:func:`phases`): a run of N steps is start-up steps 1..``STARTUP`` (DDP's
  bucket rebuild, BitDP's two fp32 steps: timed one by one), then, where the configuration
  has a compression warm-up of S steps, ``warm-up`` = steps STARTUP+1..S at full precision,
  then ``main`` (compressed) to N.
* **Step times per phase** (:func:`phase_times`): from a timing run on a shaped link, each
  phase's first step (where a codec allocates its buffers, PowerSGD its P/Q) and the mean
  of its other steps.
* **Projection** (:func:`cumulative_seconds`): the training seconds after each step of a
  quality run (its own N and S) on that link: start-up steps as measured, each phase's first
  step as measured, the rest at the phase's mean. A quality run is the same training as on
  the link (same seed, data order and plan), so its loss after step s is reached on the link
  at ``cumulative_seconds[s]``.
* **Time to target** (:func:`steps_to_target`, :func:`at_step`, :func:`step_at_seconds`):
  the first crossing of the target by the piecewise-linear validation curve (step, loss),
  mapped through the projection; loss at a budget: the curve at the step the budget buys.
* **Smoothing** (:func:`smooth`): every validation curve (the reference's for the target,
  each run's for its crossing, a full run's too) is first averaged over each evaluation and
  its neighbours, so a crossing is not decided by one noisy evaluation.
* **Seeds** (:func:`mean_std`, :func:`summary`): mean ± sample std; "not reached" unless
  every seed reached it.
* **Learning rate** (:func:`best_lr`): the lowest final validation loss; ties to the one
  nearest the default, then the smaller.
"""
from __future__ import annotations

import bisect
import math
import statistics

STARTUP = 3
#: evaluations each side of a point averaged into it (:func:`smooth`): 3 in all, 75 steps
SMOOTH = 1


def phases(steps: int, switch: int, startup: int = STARTUP) -> list[tuple[str, int, int]]:
    """``[(name, first step, last step)]`` of a run of ``steps`` steps whose compressed phase
    starts after step ``switch`` (0: no warm-up); empty phases are left out."""
    out = [("startup", 1, min(startup, steps))]
    if switch > startup:
        out.append(("warm-up", startup + 1, min(switch, steps)))
    out.append(("main", max(startup, switch) + 1, steps))
    return [(name, a, b) for name, a, b in out if a <= b]


def phase_times(step_s: list[float], switch: int, startup: int = STARTUP) -> dict:
    """A timing run's seconds per phase: ``{"startup": [s1, s2, ...], "<phase>": {"first": s,
    "mean": s, "steps": n}}`` (``mean`` over the phase's steps after its first)."""
    out: dict = {}
    for name, a, b in phases(len(step_s), switch, startup):
        times = step_s[a - 1:b]
        if name == "startup":
            out[name] = list(times)
        else:
            rest = times[1:] or times
            out[name] = {"first": times[0], "mean": statistics.fmean(rest), "steps": len(times)}
    return out


def cumulative_seconds(steps: int, switch: int, timing: dict, startup: int = STARTUP) -> list[float]:
    """Training seconds after each step 0..``steps`` of a run with compression warm-up
    ``switch``, from :func:`phase_times` of a timing run of the same configuration. A phase
    the timing run lacks (it has no warm-up, the quality run has) raises KeyError."""
    cum = [0.0]
    for name, a, b in phases(steps, switch, startup):
        for i in range(a, b + 1):
            if name == "startup":
                t = timing["startup"][min(i, len(timing["startup"])) - 1]
            else:
                t = timing[name]["first"] if i == a else timing[name]["mean"]
            cum.append(cum[-1] + t)
    return cum


def at_step(points: list[tuple[float, float]], step: float) -> float | None:
    """The piecewise-linear curve through ``(step, value)`` points at ``step`` (None outside)."""
    xs = [x for x, _ in points]
    if not points or step < xs[0] or step > xs[-1]:
        return None
    i = bisect.bisect_left(xs, step)
    if xs[i] == step:
        return points[i][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (step - x0) / (x1 - x0)


def smooth(points: list[tuple[float, float]], half: int = SMOOTH) -> list[tuple[float, float]]:
    """Each evaluation's loss averaged with ``half`` evaluations each side (fewer at the ends);
    the steps are kept. Why: near the target the validation loss moves by about 0.01 from one
    evaluation to the next and falls only 0.01-0.02 in that time, and the dips are shared by
    every method (they are evaluated on the same held-out batches). The raw curve's first
    crossing lands on whichever evaluation dips: on seed 0, DDP bf16 + AdamW, 0.0008 above DDP
    fp32 + AdamW at the target's step, crossed 35 steps later; smoothed, 1 step later."""
    out = []
    for i, (step, _) in enumerate(points):
        window = points[max(0, i - half):i + half + 1]
        out.append((step, math.fsum(v for _, v in window) / len(window)))
    return out


def steps_to_target(points: list[tuple[float, float]], target: float) -> float | None:
    """The first step at which the piecewise-linear curve reaches ``target`` (≤), None if never."""
    for i, (x, y) in enumerate(points):
        if y <= target:
            if i == 0:
                return float(x)
            x0, y0 = points[i - 1]
            return x0 + (x - x0) * (y0 - target) / (y0 - y)
    return None


def seconds_at(cum: list[float], step: float) -> float:
    """:func:`cumulative_seconds` at a fractional step (linear within a step)."""
    lo = min(int(math.floor(step)), len(cum) - 1)
    hi = min(lo + 1, len(cum) - 1)
    return cum[lo] + (cum[hi] - cum[lo]) * (step - lo)


def step_at_seconds(cum: list[float], seconds: float) -> float | None:
    """The (fractional) step reached after ``seconds`` of training; None past the run's end."""
    if seconds > cum[-1]:
        return None
    i = bisect.bisect_left(cum, seconds)
    if i == 0:
        return 0.0
    return i - 1 + (seconds - cum[i - 1]) / (cum[i] - cum[i - 1])


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summary(values: list[float | None], fmt: str = "{:.1f}") -> str:
    """``"m ± s"`` when every seed gave a value; ``"not reached"`` when none did, and
    ``"not reached in k of n seeds"`` when some did (one unreached seed makes the mean
    meaningless: it would be the mean of the lucky seeds)."""
    got = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(got) < len(values):
        return "not reached" + (f" in {len(values) - len(got)} of {len(values)} seeds" if got else "")
    m, s = mean_std(got)
    return f"{fmt.format(m)} ± {fmt.format(s)}" if len(got) > 1 else fmt.format(m)


def best_lr(final: dict[float, float], default: float) -> float:
    """The learning rate of the lowest final loss (NaN/inf lose); ties: nearest ``default``
    (in log distance), then the smaller."""
    def key(lr: float):
        loss = final[lr]
        return (loss if math.isfinite(loss) else math.inf, abs(math.log(lr / default)), lr)
    return min(final, key=key)


def target_loss(curves: list[list[tuple[float, float]]], steps: int, fraction: float = 0.8) -> float:
    """The validation loss the reference reaches at ``fraction`` of the run, mean over seeds."""
    values = [at_step(c, fraction * steps) for c in curves]
    if not values or any(v is None for v in values):
        raise ValueError(f"a reference curve does not reach step {fraction * steps:g}")
    return statistics.fmean(values)
