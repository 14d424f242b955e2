"""A whole run's time, full-precision warm-ups included (``lowbit-plan --steps``).

A steady-state step flatters the methods that first send full precision:

* torch's ``powerSGD_hook`` runs DDP's fp32 allreduce for its first ``start_powerSGD_iter``
  steps (torch's default: 1,000);
* 1-bit Adam and 1-bit LAMB until ``freeze_step``: the variance must settle first, which
  *1-bit LAMB* (arXiv:2104.06069, Sec. 3) puts at about 15 % of training for BERT, with a
  warm-up of 16.7 % in its experiments; unless given, the plan takes 20 %, as this package's
  time-to-quality benchmark does;
* TurboQuant-Adam for ``warmup_steps`` (200, ``TurboQuantAdamW``'s default).

Over a run of S steps a row with W warm-up steps takes ``W · t_warm + (S − W) · t_step``. For
PowerSGD ``t_warm`` is DDP fp32's step (torch's hook sends fp32). For this package's rows it is
the step of the uncompressed exchange in the row's own form, in ``LowBitConfig.warmup_wire``
(``bf16`` by default, ``--warmup-wire``): DDP with that wire for the flat rows, the exact mean
inside each node and that wire across for the hierarchical rows, HSDP in that wire for the
sharded rows. With ``int2`` the flat and hierarchical rows' warm-ups are BitDP 2-bit's step in
that form (what it does not code in bf16), the sharded rows' HSDP bf16's (an upper bound),
and PowerSGD's stays fp32. The warm-up's update is priced as
AdamW's (1-bit LAMB's warm-up runs LAMB, whose layerwise ratios cost about 1 % more of the run
on a 1B model; not added). In this package's time-to-quality
benchmark (4M parameters, 1,500 steps, 2 × 2 CPU ranks) the steady state alone made PowerSGD
the plan's pick, while its 1,000 fp32 steps made it the slowest to the target loss on both
links; priced over the run, it is not.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lowbit_strategy.collectives.exact import WARMUP_WIRES
from lowbit_strategy.plan.inputs import PlanError
from lowbit_strategy.plan.rows import Row

__all__ = ["ONEBIT_FREEZE_SHARE", "POWERSGD_START", "TURBOQUANT_WARMUP", "WARMUP_KEYS", "Run", "whole_run"]

#: torch's ``powerSGD_hook`` default ``start_powerSGD_iter``
POWERSGD_START = 1000
#: ``TurboQuantAdamW``'s default ``warmup_steps``
TURBOQUANT_WARMUP = 200
#: 1-bit Adam/LAMB's ``freeze_step`` as a share of the run when it is not given
ONEBIT_FREEZE_SHARE = 0.2
#: the row key prefixes of the methods with a full-precision warm-up (:meth:`Run.warmup`)
WARMUP_KEYS = ("powersgd", "onebit", "turboquant")


@dataclass(frozen=True)
class Run:
    """The run a plan prices: ``steps`` optimizer steps and each method's warm-up; checked
    here, where it is defined, so a bad value names its option."""

    steps: int
    powersgd_start: int = POWERSGD_START
    freeze_step: int | None = None
    turboquant_warmup: int = TURBOQUANT_WARMUP
    #: what this package's warm-ups send (``LowBitConfig.warmup_wire``)
    warmup_wire: str = "bf16"

    def __post_init__(self):
        if self.steps < 1:
            raise PlanError("--steps", self.steps, "pass the run's optimizer steps, >= 1")
        # the optimizers' own bounds: torch's PowerSGDState wants start_powerSGD_iter > 1 with its
        # error feedback and warm start; OneBitAdam/OneBitLamb a freeze_step >= 1
        if self.warmup_wire not in WARMUP_WIRES:
            raise PlanError("--warmup-wire", self.warmup_wire, "pass bf16, fp32 or int2 (LowBitConfig.warmup_wire)")
        for option, value, least in (
            ("--powersgd-start", self.powersgd_start, 2),
            ("--freeze-step", self.freeze_step, 1),
            ("--turboquant-warmup", self.turboquant_warmup, 0),
        ):
            if value is not None and value < least:
                raise PlanError(option, value, f"pass a number of warm-up steps >= {least}")

    def warmup(self, key: str) -> int:
        """The full-precision steps of the row ``key`` (a :class:`Row` key), at most the run."""
        if key == "powersgd":
            steps = self.powersgd_start
        elif key.startswith("onebit"):
            share = max(1, round(ONEBIT_FREEZE_SHARE * self.steps))
            steps = self.freeze_step if self.freeze_step is not None else share
        elif key.startswith("turboquant"):
            steps = self.turboquant_warmup
        else:
            steps = 0
        return min(steps, self.steps)

    def describe(self) -> str:
        freeze = self.warmup("onebit")
        return (
            f"a run of {self.steps:,} steps, full-precision warm-ups priced at the uncompressed step of each row's "
            f"form (PowerSGD fp32, this package's {self.warmup_wire}): "
            f"PowerSGD {self.warmup('powersgd'):,} (start_powerSGD_iter), 1-bit Adam/LAMB {freeze:,} (freeze_step"
            + ("" if self.freeze_step is not None else f", {ONEBIT_FREEZE_SHARE:.0%} of the run")
            + f"), TurboQuant-Adam {self.warmup('turboquant'):,} (warmup_steps)"
        )


def whole_run(rows: list[Row], run: Run, warm_step: dict[str, float]) -> list[Row]:
    """``rows`` with their warm-up steps, the whole run's seconds and the speed-up over DDP bf16's
    run (which has no warm-up); ``warm_step`` the warm-up's step seconds: ``"powersgd"``'s (DDP
    fp32's) and, by form, this package's rows' (their uncompressed exchange in ``run.warmup_wire``)."""
    base = run.steps * next(r for r in rows if r.key == "ddp_bf16").step_s
    out = []
    for r in rows:
        warm = run.warmup(r.key)
        t_warm = warm_step["powersgd"] if r.key == "powersgd" else warm_step.get(r.form, 0.0)
        seconds = warm * t_warm + (run.steps - warm) * r.step_s if warm else run.steps * r.step_s
        out.append(replace(r, warmup_steps=warm, run_s=seconds, speedup=base / seconds))
    return out
