"""Lion Cub's section of :class:`~lowbit_strategy.config.LowBitConfig` (``config.lion``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from lowbit_strategy.section import Section
from lowbit_strategy.validation import ConfigError, as_bool, as_choice, as_int, as_patterns, is_none

MODES = ("auto", "1bit", "sign", "lp", "fp32", "bf16")
WIRE_LANES = (2, 4, 8, 16, 32)
LAYER_KEYWORDS = ("auto", "all", "none")
#: ``bits`` without a ``mode``: the paper's names ("1-bit", "4-bit" sign votes, "8-bit" L1
#: codes, "16/32-bit" uncompressed).
BITS_TO_MODE = {1: "1bit", 2: "sign", 4: "sign", 8: "lp", 16: "bf16", 32: "fp32"}
#: the lane widths each mode accepts (None: the mode's default)
ALLOWED_BITS = {
    "auto": (None,),
    "1bit": (None, 1),
    "sign": (None,) + WIRE_LANES,
    "lp": (None, 4, 8, 16, 32),  # (2-bit lanes cannot hold codes in [-1, 1] summed over 2 ranks)
    "fp32": (None, 32),
    "bf16": (None, 16),
}


@dataclass(frozen=True)
class LionConfig(Section):
    """Lion Cub: how a distributed Lion synchronizes its update vector.

    mode: ``1bit`` (majority vote), ``sign`` (0/1 votes summed in packed lanes), ``lp``
        (L_p-quantized codes summed in lanes), ``fp32`` / ``bf16`` (exact baseline) or
        ``auto`` (the cost model picks from the world size, the bucket size and the link).
    bits: the lane width on the wire for ``sign``/``lp`` (2, 4, 8, 16, 32; None: the
        narrowest lane holding P votes for ``sign``, 8 for ``lp``); 1 for ``1bit``; 32 for
        ``fp32``; 16 for ``bf16``. With ``mode="auto"``, ``bits`` picks the mode the paper
        means by that width (:data:`BITS_TO_MODE`: 1 -> 1bit, 4 -> sign, 8 -> lp).
    p: the norm of L_p quantization (Lion Cub Eq. 1): 0, 1, 2 or inf.
    momentum_sync_every: average momenta across ranks every k optimizer steps (Sec. 5);
        0 never does.
    momentum_sync_layers: which momenta: ``auto`` (input embedding and output head),
        ``all``, ``none`` or parameter-name patterns (fnmatch; each must match).
    overlap: start each DDP bucket's collective from the communication hook, during
        backward (True), or synchronize everything in ``optimizer.step()`` (False). Same
        result bit for bit. Gradients changed between backward and ``step()`` (gradient
        clipping) need ``False``: the Lightning strategy turns it off itself when
        ``gradient_clip_val`` is set, and says so once.
    """

    name: ClassVar[str] = "lion"

    mode: str = "auto"
    bits: int | None = None
    p: float = 1.0
    momentum_sync_every: int = 0
    momentum_sync_layers: str | tuple[str, ...] = "auto"
    overlap: bool = True

    def __post_init__(self) -> None:
        f = self.field_name
        mode = self.mode.strip().lower() if isinstance(self.mode, str) else self.mode
        mode = as_choice(f("mode"), mode, MODES)
        bits = None if is_none(self.bits) else as_int(f("bits"), self.bits, 1)
        if mode == "auto" and bits is not None:
            if bits not in BITS_TO_MODE:
                raise ConfigError(
                    f("bits"), self.bits, f"with mode='auto' allowed: None, {', '.join(map(str, BITS_TO_MODE))}"
                )
            mode = BITS_TO_MODE[bits]
        if bits not in ALLOWED_BITS[mode]:
            shown = ", ".join("None" if b is None else str(b) for b in ALLOWED_BITS[mode])
            raise ConfigError(f("bits"), self.bits, f"with mode={mode!r} allowed: {shown}")
        self._set("mode", mode)
        self._set("bits", bits)
        self._set("p", self._checked_p(self.p))
        self._set("momentum_sync_every", as_int(f("momentum_sync_every"), self.momentum_sync_every, 0))
        self._set("momentum_sync_layers", self._checked_layers(self.momentum_sync_layers))
        self._set("overlap", as_bool(f("overlap"), self.overlap))

    @classmethod
    def _checked_p(cls, value: Any) -> float:
        text = value.strip().lower() if isinstance(value, str) else value
        if text in ("inf", "infinity"):
            return math.inf
        try:
            out = float(text)
        except (TypeError, ValueError):
            out = None
        if isinstance(value, bool) or out not in (0.0, 1.0, 2.0, math.inf):
            raise ConfigError(cls.field_name("p"), value, "allowed: 0, 1, 2, inf (the norm of L_p quantization)")
        return out

    @classmethod
    def _checked_layers(cls, value: Any) -> str | tuple[str, ...]:
        if isinstance(value, str) and value.strip().lower() in LAYER_KEYWORDS:
            return value.strip().lower()
        try:
            return as_patterns(cls.field_name("momentum_sync_layers"), value) or "none"
        except ConfigError:
            raise ConfigError(
                cls.field_name("momentum_sync_layers"),
                value,
                "allowed: 'auto', 'all', 'none', or a non-empty list of parameter-name patterns",
            ) from None
