"""What the planner's rows are made of: the :class:`Row` every prediction returns, the
constants the methods' rows share, and the per-element codec count of TurboQuant's forms
(:mod:`~lowbit_strategy.plan.predict` prices the flat and hierarchical rows,
:mod:`~lowbit_strategy.plan.predict_sharded` the sharded ones)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lowbit_strategy.plan.inputs import Shape

#: 1-bit Adam/LAMB's default scale block (``onebit_*.scale_block``)
ONEBIT_BLOCK = 32768
#: PowerSGD's rank, and the compression rate below which a matrix is sent uncompressed
POWERSGD_RANK, POWERSGD_MIN_RATE = 4, 2.0
#: TurboQuant's candidate forms (``auto`` takes the fastest per bucket)
TURBOQUANT_FORMS = ("fp32", "turboquant_two_stage", "turboquant_allgather")


@dataclass(frozen=True)
class Row:
    """One method in one form: ``link_bytes`` per step leaving each node (each direction),
    ``comm_s`` its communication, ``exposed_s`` what of it the step waits for, ``codec_s``,
    ``step_s``, ``memory_bytes`` per GPU, ``speedup`` over DDP bf16 (of the whole run when
    ``run_s`` is priced, else of the step), ``config`` how to ask for it."""

    key: str
    method: str
    form: str
    config: str
    link_bytes: float
    comm_s: float
    exposed_s: float
    codec_s: float
    step_s: float
    memory_bytes: float
    speedup: float = 0.0
    #: whether weights, gradients and this state fit the GPU's memory (None: unknown)
    fits: bool | None = field(default=None)
    #: the run's full-precision warm-up steps, priced at the fp32 step of this row's form
    warmup_steps: int = 0
    #: the whole run's seconds, warm-up included (``lowbit-plan --steps``); None: steady state only
    run_s: float | None = None

    @property
    def time_s(self) -> float:
        """What rows are ranked by: the whole run's seconds when priced, else the step's."""
        return self.step_s if self.run_s is None else self.run_s


def turboquant_codec_ns(codec_ns: dict[str, float] | None, form: str, ranks: int) -> float:
    """TurboQuant's local nanoseconds per element of a bucket sent in ``form`` (a
    :data:`TURBOQUANT_FORMS` name) among ``ranks``, counted as the algorithm's own plan counts
    them (:func:`~lowbit_strategy.algorithms.turboquant.form.measure_codec_seconds`):
    ``allgather`` one encode, P decodes and P + 2 adds; ``two_stage`` (1 + 1/P) encodes,
    (2 + 1/P) decodes and 4 adds (the server's re-encode of its chunk, the final decode of
    every chunk); ``fp32`` none counted (its 1/P scaling is noise beside the wire). From
    ``turboquant_encode``/``turboquant_decode``/``add`` when measured, else ``turboquant``
    (encode + decode) once, as reports without the split give it."""
    ns = codec_ns or {}
    if form == "fp32":
        return 0.0
    if "turboquant_encode" not in ns or "turboquant_decode" not in ns:
        return ns.get("turboquant", 0.0)
    enc, dec, add, p = ns["turboquant_encode"], ns["turboquant_decode"], ns.get("add", 0.0), ranks
    if form == "turboquant_allgather":
        return enc + p * dec + (p + 2) * add
    return (1 + 1 / p) * enc + (2 + 1 / p) * dec + 4 * add


def as_matrix(shape: Shape) -> tuple[int, int] | None:
    """A parameter as BitDP/PowerSGD see it: a matrix (rows = dim 0), or None for a vector."""
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else None
