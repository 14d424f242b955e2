"""BitDP's section of :class:`~lowbit_strategy.config.LowBitConfig` (``config.bitdp``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lowbit_strategy.section import Section
from lowbit_strategy.validation import ConfigError, as_bool, as_choice, as_int, as_patterns, is_none

REDUCTIONS = ("mean", "paper")
#: accepted values of ``form``
FORMS = ("auto", "allgather", "two_stage")


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
    form: the collective. ``allgather`` (the paper's: every rank's codes to every rank,
        the exact mean of the dequantized gradients; ``(P-1)·(W + 4R)`` bytes per rank for W
        code bytes and R row scales, 7.9x below float32 at P = 4 at 2 bits, nothing at
        P = 32); ``two_stage`` (codes reduce-scattered at whole rows, each rank averages its
        chunk exactly, re-encodes it with its own server error feedback, all-gather:
        ``≈ 2(P-1)/P·(W + 4R)``, flat in P, needs ``reduction: mean``); ``auto`` (default):
        once per run, the all-gather unless the α–β cost model on the configured link
        (``link_bandwidth_gbps``, ``link_latency_us``) predicts it at least twice as slow
        as the two-stage form (so the all-gather at P <= 4, and with ``reduction: paper``).
    """

    name: ClassVar[str] = "bitdp"

    bits: int = 2
    quantize: tuple[str, ...] | None = None
    exclude: tuple[str, ...] | None = None
    reduction: str = "mean"
    error_feedback: bool = False
    form: str = "auto"

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
        self._set("form", as_choice(f("form"), self.form, FORMS))
        if self.form == "two_stage" and self.reduction != "mean":
            raise ConfigError(
                f("form"),
                self.form,
                "two_stage averages exactly (reduction: mean); with reduction: paper use allgather",
            )
