"""The factories Lightning's strategy registry calls for this package's names."""

from __future__ import annotations

from typing import Any


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
