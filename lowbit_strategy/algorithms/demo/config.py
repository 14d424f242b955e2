"""DeMo's section of :class:`~lowbit_strategy.config.LowBitConfig` (``config.demo``).

The optimizer's own arguments (``compression_decay``, ``compression_topk``,
``compression_chunk``, ``weight_decay``, ``lr``) stay on :class:`~.optimizer.DeMo`, as in the
paper's published class, so a DeMo user changes one import; the section holds what the
exchange sends and when it lands.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lowbit_strategy.codecs.topk import VALUES
from lowbit_strategy.section import Section
from lowbit_strategy.validation import ConfigError, as_choice, as_int


@dataclass(frozen=True)
class DeMoConfig(Section):
    """Decoupled momentum ("DeMo: Decoupled Momentum Optimization", Peng, Quesnelle, Kingma,
    arXiv:2411.19870): every step each worker sends the top-k DCT coefficients of its momentum.

    values: how each kept coefficient crosses the link (:mod:`lowbit_strategy.codecs.topk`):
        ``sign`` (default: one bit per coefficient and one bf16 scale per chunk; the worker
        removes from its momentum exactly what it sent), ``bf16``, or ``fp32`` (the paper's).
        Indices always travel packed to ``⌈log2(chunk size)⌉`` bits.
    delay: 0, or 1: the gathered update is applied at the next step, so the exchange runs
        while that step's forward and backward do (Psyche's one-step-late update).
    """

    name: ClassVar[str] = "demo"

    values: str = "sign"
    delay: int = 0

    def __post_init__(self) -> None:
        f = self.field_name
        self._set("values", as_choice(f("values"), self.values, VALUES))
        delay = as_int(f("delay"), self.delay, 0)
        if delay not in (0, 1):
            raise ConfigError(
                f("delay"), self.delay, "expected 0 (apply at once) or 1 (apply at the next step, overlapped)"
            )
        self._set("delay", delay)
