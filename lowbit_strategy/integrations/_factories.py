"""What the Lightning strategies share without importing Lightning: the registry's factories
and the split of a strategy's keyword arguments into config fields and the rest."""

from __future__ import annotations

from typing import Any

from lowbit_strategy.config import LowBitConfig


def config_from(config: LowBitConfig | dict | str | None, kwargs: dict[str, Any]) -> LowBitConfig:
    """``config`` with the keyword arguments :class:`LowBitConfig` accepts (shared fields,
    sections, section fields) applied as overrides; those are removed from ``kwargs``, which
    keeps the strategy base class's own."""
    known = set(LowBitConfig.known_keys())
    overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in known}
    return LowBitConfig.coerce(config, **overrides)


def named_factory(name: str, cls: type):
    """The registry's factory of strategy ``name``: ``cls`` built with the keyword arguments
    the name was registered with, remembering the name it was asked by (``_lowbit_name``: the
    strategy's messages name what the user wrote)."""

    def make(**kwargs: Any):
        strategy = cls(**kwargs)
        strategy._lowbit_name = name
        return strategy

    make.__name__ = f"{cls.__name__}[{name}]"
    return make
