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
import numbers
import reprlib
from collections.abc import Iterable
from typing import Any

import torch

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


#: how values are shown in messages: shortened (a 450-byte YAML file of nested aliases once
#: made a 55 MB message)
SHORT = reprlib.Repr()
SHORT.maxstring, SHORT.maxother, SHORT.maxlist, SHORT.maxtuple, SHORT.maxdict, SHORT.maxlevel = 240, 60, 6, 6, 6, 3


def short(value: Any) -> str:
    """``repr(value)``, shortened to a few dozen characters."""
    return SHORT.repr(value)


class ConfigError(ValueError):
    """An invalid configuration value; ``field`` and ``value`` say which."""

    def __init__(self, field_name: str, value: Any, allowed: str):
        self.field = field_name
        self.value = value
        super().__init__(f"LowBitConfig.{field_name}: got {short(value)}; {allowed}")


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


def exact_int(value: Any) -> int | None:
    """``value`` as an int if it is exactly an integer of any numeric type (int, numpy or
    torch integer, an integral float, Decimal or one-element tensor, a string of digits),
    else None. Never truncates: 8.5 from any type is None, as are bools, NaN and infinities."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            return None
        return exact_int(value.item())
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    if not math.isfinite(number) or not number.is_integer() or (not isinstance(value, float) and value != int(number)):
        return None  # (Decimal("8.0000000000000000001") is 8.0 as a float, but not 8)
    return int(number)


def as_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """An exact integer in ``[minimum, maximum]`` (any numeric type; 8.5 never becomes 8)."""
    span = f">= {minimum}" + ("" if maximum is None else f" and <= {maximum}")
    out = exact_int(value)
    if out is None or out < minimum or (maximum is not None and out > maximum):
        raise ConfigError(name, value, f"expected an integer {span}")
    return out


def as_float(name: str, value: Any, *, positive: bool, maximum: float | None = None) -> float:
    allowed = "expected a finite number " + ("> 0" if positive else ">= 0")
    allowed += f" and <= {maximum:g}" if maximum is not None else ""
    if isinstance(value, bool):
        raise ConfigError(name, value, allowed)
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(name, value, allowed) from None
    if not math.isfinite(out) or out < 0 or (positive and out == 0) or (maximum is not None and out > maximum):
        raise ConfigError(name, value, allowed)
    return out


def as_float_or_measure(name: str, value: Any, *, positive: bool) -> float | str:
    """``"measure"`` (any case, from YAML or the environment) or a number as :func:`as_float`
    takes it; the error names both forms."""
    if isinstance(value, str) and value.strip().lower() == "measure":
        return "measure"
    try:
        return as_float(name, value, positive=positive)
    except ConfigError:
        limit = "> 0" if positive else ">= 0"
        raise ConfigError(
            name, value, f"expected 'measure' (probe the link at attach) or a finite number {limit}"
        ) from None


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
    """``value`` as a float; ``ValueError`` naming ``cls`` and ``name`` unless it is a finite
    real number (not a bool, NaN or an infinity) in ``[low, high)`` (``(low, high)`` with
    ``low_open``). For constructor arguments of optimizers and layers (config fields use the
    converters above, which raise :class:`ConfigError`)."""
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(float(value))
    ok = ok and (value > low if low_open else value >= low) and (high is None or value < high)
    if not ok:
        span = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'})"
        raise ValueError(f"{cls}: {name} must be a number in {span} (finite), got {short(value)}")
    return float(value)


def is_int(value: Any, low: int | None = None, high: int | None = None) -> bool:
    """Whether ``value`` is a Python int in ``[low, high]`` (either bound None: open). Strict,
    for function and constructor arguments: a bool, float (8.0), string or numpy integer is
    a caller's mistake there (config fields, which may come from strings, use :func:`as_int`)."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (low is None or value >= low)
        and (high is None or value <= high)
    )


def _bound(value: int) -> str:
    """``value`` as written in a message: ``2**63 - 1`` rather than its 19 digits."""
    return f"2**{value.bit_length()} - 1" if value >= 2**16 and (value + 1) & value == 0 else str(value)


def check_int(cls: str, name: str, value: Any, low: int, high: int | None = None, *, what: str = "") -> int:
    """``value`` if :func:`is_int` in ``[low, high]``, else ``ValueError`` naming ``cls`` (the
    class or function), ``name``, the value and the range; ``what`` (e.g. ``" (4 is the
    paper's)"``) explains the argument."""
    if not is_int(value, low, high):
        if high is not None:
            span = f"an int in [{low}, {_bound(high)}]"
        else:
            span = "a positive int" if low == 1 else f"an int >= {low}"
        raise ValueError(f"{cls}: {name} must be {span}{what}, got {short(value)}")
    return value
