"""BitDP's section of :class:`~lowbit_strategy.config.LowBitConfig` (``config.bitdp``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lowbit_strategy.section import Section
from lowbit_strategy.validation import ConfigError, as_bool, as_choice, as_int, as_patterns, is_none

REDUCTIONS = ("mean", "paper")


@dataclass(frozen=True)
class BitDPConfig(Section):
    """BitDP: channel-wise 1/2-bit gradients in a DDP communication hook.

    bits: 1 (binary codes, Eq. 5-6) or 2 (ternary codes, Eq. 7-9).
    quantize: parameter-name patterns (fnmatch) quantized instead of the default rule
        (linear weights, not embeddings, Sec. 3.1.1); None keeps the default.
    exclude: patterns never quantized (win over ``quantize``).
    reduction: ``mean`` (exact mean of dequantized gradients) or ``paper`` (Eq. 10:
        reduced scales times reduced codes).
    error_feedback: keep each rank's quantization residual and add it to the next
        gradient (not in the paper; off by default). Checkpointed per rank.
    """

    name: ClassVar[str] = "bitdp"

    bits: int = 2
    quantize: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None
    reduction: str = "mean"
    error_feedback: bool = False

    def __post_init__(self) -> None:
        f = self.field_name
        bits = 2 if is_none(self.bits) else as_int(f("bits"), self.bits, 1)
        if bits not in (1, 2):
            raise ConfigError(f("bits"), self.bits, "BitDP quantizes gradients to 1 or 2 bits (Sec. 3.1.2)")
        self._set("bits", bits)
        self._set("quantize", as_patterns(f("quantize"), self.quantize))
        self._set("exclude", as_patterns(f("exclude"), self.exclude))
        self._set("reduction", as_choice(f("reduction"), self.reduction, REDUCTIONS))
        self._set("error_feedback", as_bool(f("error_feedback"), self.error_feedback))
