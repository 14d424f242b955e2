"""LowBitConfig: one typed, validated configuration for every front end.

Build it from keyword arguments, a dict (:meth:`LowBitConfig.from_dict`), a YAML file
(:meth:`LowBitConfig.from_yaml`, read with ``yaml.safe_load``) or environment variables
(:meth:`LowBitConfig.from_env`, ``LOWBIT_<FIELD>``). Strings (from YAML or the
environment) are converted to each field's type. Every invalid value raises
:class:`ConfigError`, which names the field, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

ALGORITHMS = ("lion", "bitdp", "onebit_adam", "onebit_lamb", "turboquant_adam")
LION_MODES = ("auto", "1bit", "sign", "lp", "fp32", "bf16")
WIRE_LANES = (2, 4, 8, 16, 32)
LAYER_KEYWORDS = ("auto", "all", "none")
#: Lion with ``bits`` but no ``mode``: the paper's names ("1-bit", "4-bit" sign votes,
#: "8-bit" L1 codes, "16/32-bit" uncompressed).
BITS_TO_LION_MODE = {1: "1bit", 2: "sign", 4: "sign", 8: "lp", 16: "bf16", 32: "fp32"}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class ConfigError(ValueError):
    """An invalid configuration value; ``field`` and ``value`` say which."""

    def __init__(self, field_name: str, value: Any, allowed: str):
        self.field = field_name
        self.value = value
        super().__init__(f"LowBitConfig.{field_name}: got {value!r}; {allowed}")


def _as_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        raise ConfigError(name, value, f"expected an integer >= {minimum}")
    if isinstance(value, str):
        value = value.strip()
    try:
        out = int(value)
        if isinstance(value, float) and out != value:
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(name, value, f"expected an integer >= {minimum}") from None
    if out < minimum:
        raise ConfigError(name, value, f"expected an integer >= {minimum}")
    return out


def _as_float(name: str, value: Any, *, positive: bool) -> float:
    allowed = "expected a finite number " + ("> 0" if positive else ">= 0")
    if isinstance(value, bool):
        raise ConfigError(name, value, allowed)
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ConfigError(name, value, allowed) from None
    if not math.isfinite(out) or out < 0 or (positive and out == 0):
        raise ConfigError(name, value, allowed)
    return out


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(name, value, "expected a boolean (true/false, 1/0, yes/no)")


def _as_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    text = value.strip().lower() if isinstance(value, str) else value
    if text not in choices:
        hint = difflib.get_close_matches(str(value), choices, n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(name, value, f"allowed: {', '.join(choices)}{extra}")
    return text


@dataclass(frozen=True)
class LowBitConfig:
    """Every knob of the low-bit algorithms.

    algorithm: which paper's algorithm drives synchronization: ``lion`` (Lion Cub),
        ``bitdp``, ``onebit_adam``, ``onebit_lamb`` or ``turboquant_adam``.
    mode: how Lion Cub synchronizes its update vector: ``1bit`` (majority vote), ``sign``
        (0/1 votes summed in packed lanes), ``lp`` (L_p-quantized codes summed in lanes),
        ``fp32`` / ``bf16`` (exact baseline) or ``auto`` (the cost model picks from the
        world size, the bucket size and the link below). Lion only.
    bits: bits on the wire. Lion ``sign``/``lp``: the lane width (2, 4, 8, 16, 32; None
        means the narrowest lane that holds P votes for ``sign`` and 8 for ``lp``);
        ``1bit``: 1; ``fp32``: 32; ``bf16``: 16. With ``mode="auto"``, giving ``bits`` picks the
        mode the paper means by that width (:data:`BITS_TO_LION_MODE`: 4 -> sign, 8 -> lp).
        BitDP: 1 or 2 (default 2). 1-bit Adam/LAMB: 1. TurboQuant-Adam: 4.
    p: the norm of L_p quantization (Lion Cub Eq. 1): 0, 1, 2 or inf.
    bucket_size_mb: size of the flat buckets synchronized with one collective each.
    momentum_sync_every: average the momentum across ranks every k steps (Lion Cub
        Sec. 5); 0 never does.
    momentum_sync_layers: which momenta to average: ``auto`` (input embedding and output
        head), ``all``, ``none`` or a tuple of parameter-name patterns (fnmatch).
    warmup_steps: steps run uncompressed before compression starts.
    link_bandwidth_gbps, link_latency_us: the network the ``auto`` mode plans for.
    bitdp_quantize: BitDP only: parameter-name patterns to quantize instead of the default
        rule (linear weights, no embeddings); None keeps the default.
    bitdp_exclude: BitDP only: patterns never quantized (win over ``bitdp_quantize``).
    bitdp_reduction: BitDP only: ``mean`` (exact mean of dequantized gradients) or
        ``paper`` (Eq. 10: reduced scales times reduced codes).
    bitdp_error_feedback: BitDP only: keep each rank's quantization residual and add it to
        the next gradient (not in the paper; off by default). Checkpointed per rank.
    debug: run extra checks (one more small collective per call verifying that every
        rank passes the same lengths).
    """

    algorithm: str = "lion"
    mode: str = "auto"
    bits: int | None = None
    p: float = 1.0
    bucket_size_mb: float = 25.0
    momentum_sync_every: int = 0
    momentum_sync_layers: str | tuple[str, ...] = "auto"
    warmup_steps: int = 0
    link_bandwidth_gbps: float = 1.0
    link_latency_us: float = 50.0
    bitdp_quantize: tuple[str, ...] | None = None
    bitdp_exclude: tuple[str, ...] | None = None
    bitdp_reduction: str = "mean"
    bitdp_error_feedback: bool = False
    debug: bool = False

    def __post_init__(self) -> None:
        set_ = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 (frozen)
        set_("algorithm", _as_choice("algorithm", self.algorithm, ALGORITHMS))
        set_("mode", _as_choice("mode", self.mode, LION_MODES))
        set_("p", self._checked_p(self.p))
        set_("bucket_size_mb", _as_float("bucket_size_mb", self.bucket_size_mb, positive=True))
        set_("momentum_sync_every", _as_int("momentum_sync_every", self.momentum_sync_every, 0))
        set_("momentum_sync_layers", self._checked_layers(self.momentum_sync_layers))
        set_("warmup_steps", _as_int("warmup_steps", self.warmup_steps, 0))
        set_("link_bandwidth_gbps", _as_float("link_bandwidth_gbps", self.link_bandwidth_gbps, positive=True))
        set_("link_latency_us", _as_float("link_latency_us", self.link_latency_us, positive=False))
        set_("debug", _as_bool("debug", self.debug))
        set_("bitdp_quantize", self._checked_patterns("bitdp_quantize", self.bitdp_quantize))
        set_("bitdp_exclude", self._checked_patterns("bitdp_exclude", self.bitdp_exclude))
        set_("bitdp_reduction", _as_choice("bitdp_reduction", self.bitdp_reduction, ("mean", "paper")))
        set_("bitdp_error_feedback", _as_bool("bitdp_error_feedback", self.bitdp_error_feedback))
        if self.algorithm == "lion" and self.mode == "auto" and self.bits not in (None, "", "none"):
            bits = _as_int("bits", self.bits, 1)
            if bits not in BITS_TO_LION_MODE:
                raise ConfigError("bits", self.bits, f"with mode='auto' allowed: None, {', '.join(map(str, BITS_TO_LION_MODE))}")
            set_("mode", BITS_TO_LION_MODE[bits])
        set_("bits", self._checked_bits(self.bits))

    @staticmethod
    def _checked_p(value: Any) -> float:
        text = value.strip().lower() if isinstance(value, str) else value
        if text in ("inf", "infinity"):
            return math.inf
        try:
            out = float(text)
        except (TypeError, ValueError):
            out = None
        if isinstance(value, bool) or out not in (0.0, 1.0, 2.0, math.inf):
            raise ConfigError("p", value, "allowed: 0, 1, 2, inf (the norm of L_p quantization)")
        return out

    @staticmethod
    def _checked_layers(value: Any) -> str | tuple[str, ...]:
        if isinstance(value, str):
            text = value.strip()
            if text.lower() in LAYER_KEYWORDS:
                return text.lower()
            value = [part for part in text.split(",")]
        if isinstance(value, (list, tuple)):
            patterns = tuple(str(v).strip() for v in value)
            if patterns and all(patterns) and all(isinstance(v, str) for v in value):
                return patterns
        raise ConfigError(
            "momentum_sync_layers", value,
            "allowed: 'auto', 'all', 'none', or a non-empty list of parameter-name patterns",
        )

    @staticmethod
    def _checked_patterns(name: str, value: Any) -> tuple[str, ...] | None:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
            return None
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v.strip() for v in value):
            return tuple(v.strip() for v in value)
        raise ConfigError(name, value, "expected None or a non-empty list of parameter-name patterns (fnmatch)")

    def _checked_bits(self, value: Any) -> int | None:
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
            value = None
        else:
            value = _as_int("bits", value, 1)
        allowed = self._allowed_bits()
        if value not in allowed:
            shown = ", ".join("None" if b is None else str(b) for b in allowed)
            what = f"algorithm={self.algorithm!r}" + (f", mode={self.mode!r}" if self.algorithm == "lion" else "")
            raise ConfigError("bits", value, f"with {what} allowed: {shown}")
        if self.algorithm != "lion" and self.mode != "auto":
            raise ConfigError("mode", self.mode, f"mode applies to algorithm='lion' only; leave it 'auto' for {self.algorithm!r}")
        return value

    def _allowed_bits(self) -> tuple[int | None, ...]:
        if self.algorithm == "lion":
            return {
                "auto": (None,),
                "1bit": (None, 1),
                "sign": (None,) + WIRE_LANES,
                "lp": (None,) + WIRE_LANES,
                "fp32": (None, 32),
                "bf16": (None, 16),
            }[self.mode]
        return {
            "bitdp": (None, 1, 2),
            "onebit_adam": (None, 1),
            "onebit_lamb": (None, 1),
            "turboquant_adam": (None, 4),
        }[self.algorithm]

    # ---- front ends -------------------------------------------------------------
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "LowBitConfig":
        """From a mapping; unknown keys raise :class:`ConfigError` with a suggestion."""
        if not isinstance(values, Mapping):
            raise ConfigError("<root>", values, "expected a mapping of field names to values")
        names = cls.field_names()
        for key in values:
            if key not in names:
                hint = difflib.get_close_matches(str(key), names, n=1)
                extra = f" (did you mean {hint[0]!r}?)" if hint else ""
                raise ConfigError(str(key), values[key], f"unknown field{extra}; fields are: {', '.join(names)}")
        return cls(**dict(values))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "LowBitConfig":
        """From a YAML mapping, either at the top level or under a ``lowbit:`` key."""
        import yaml

        text = Path(path).read_text()
        data = yaml.safe_load(text) or {}
        if isinstance(data, Mapping) and set(data) == {"lowbit"}:
            data = data["lowbit"]
        return cls.from_dict(data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, prefix: str = "LOWBIT_", **defaults: Any) -> "LowBitConfig":
        """From ``LOWBIT_<FIELD>`` variables (e.g. ``LOWBIT_MODE=lp``), over ``defaults``."""
        env = os.environ if environ is None else environ
        values = dict(defaults)
        for name in cls.field_names():
            key = prefix + name.upper()
            if key in env:
                values[name] = env[key]
        unknown = [k for k in env if k.startswith(prefix) and k[len(prefix):].lower() not in cls.field_names()]
        if unknown:
            raise ConfigError(unknown[0][len(prefix):].lower(), env[unknown[0]],
                              f"unknown variable {unknown[0]}; fields are: {', '.join(cls.field_names())}")
        return cls.from_dict(values)

    @classmethod
    def coerce(cls, source: "LowBitConfig | Mapping[str, Any] | str | os.PathLike | None" = None, **overrides: Any) -> "LowBitConfig":
        """Any accepted form (config, dict, YAML path or None) with keyword overrides on top."""
        if source is None:
            base: dict[str, Any] = {}
        elif isinstance(source, LowBitConfig):
            base = source.to_dict()
        elif isinstance(source, Mapping):
            base = dict(source)
        elif isinstance(source, (str, os.PathLike)):
            base = cls.from_yaml(source).to_dict()
        else:
            raise ConfigError("<root>", source, "expected a LowBitConfig, a dict, a YAML file path or None")
        base.update(overrides)
        return cls.from_dict(base)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "LowBitConfig":
        return self.coerce(self, **changes)
