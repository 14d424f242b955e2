"""Field converters shared by :class:`~lowbit_strategy.config.LowBitConfig` and every
algorithm's config section.

Values arrive as Python objects (keyword arguments) or as strings (YAML scalars are typed
already, ``LOWBIT_*`` environment variables are not); each converter accepts both, returns
the field's type, and raises :class:`ConfigError` naming the field, the value and what is
allowed. Config objects validate once, when they are built; the hot paths trust them.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class ConfigError(ValueError):
    """An invalid configuration value; ``field`` and ``value`` say which."""

    def __init__(self, field_name: str, value: Any, allowed: str):
        self.field = field_name
        self.value = value
        super().__init__(f"LowBitConfig.{field_name}: got {value!r}; {allowed}")


class ConfigMismatchError(ConfigError):
    """The ranks of one run disagree on their configuration; raised on every rank, with the
    same message, naming the fields and the ranks (:attr:`fields`: the differing names)."""

    def __init__(self, message: str, fields: list[str]):
        self.field = fields[0] if fields else "<root>"
        self.fields = list(fields)
        self.value = None
        ValueError.__init__(self, message)


def suggestion(value: Any, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or an empty string."""
    hint = difflib.get_close_matches(str(value), list(choices), n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def is_none(value: Any) -> bool:
    """None, or a string spelling it (``""``, ``"none"``, ``"null"``) from YAML or the environment."""
    return value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null"))


def as_int(name: str, value: Any, minimum: int) -> int:
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


def as_float(name: str, value: Any, *, positive: bool) -> float:
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


def as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(name, value, "expected a boolean (true/false, 1/0, yes/no)")


def as_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    text = value.strip().lower() if isinstance(value, str) else value
    if text not in choices:
        raise ConfigError(name, value, f"allowed: {', '.join(choices)}{suggestion(value, choices)}")
    return text


def as_patterns(name: str, value: Any) -> tuple[str, ...] | None:
    """None, or a non-empty tuple of fnmatch patterns (a comma-separated string is split)."""
    if is_none(value):
        return None
    if isinstance(value, str):
        value = value.split(",")
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v.strip() for v in value):
        return tuple(v.strip() for v in value)
    raise ConfigError(
        name, value, "expected None or a non-empty list of parameter-name patterns (fnmatch), e.g. ['*.attn.*.weight']"
    )


def check_number(
    cls: str, name: str, value: Any, low: float, high: float | None = None, low_open: bool = False
) -> float:
    """``value`` as a float; ``ValueError`` naming ``cls`` and ``name`` unless it is a real
    number (not a bool, not NaN) in ``[low, high)`` (``(low, high)`` with ``low_open``).
    For constructor arguments of optimizers and layers (config fields use the converters
    above, which raise :class:`ConfigError`)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    ok = ok and (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        span = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'})"
        raise ValueError(f"{cls}: {name} must be a number in {span}, got {value!r}")
    return float(value)
