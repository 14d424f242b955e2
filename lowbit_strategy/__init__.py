"""lowbit-strategy: data-parallel training with 4-32x fewer bytes on the wire.

``import lowbit_strategy`` registers the Lightning strategies (``lowbit_lion`` and family),
so it must come before ``Trainer(strategy="lowbit_lion")``. Importing touches no CUDA and
compiles nothing (safe before a notebook's fork); re-importing re-registers harmlessly.
"""
from lowbit_strategy.config import ConfigError, LowBitConfig
from lowbit_strategy.lightning import LowBitSetupError, LowBitStrategy, register_strategies
from lowbit_strategy.optim import Lion, LionCommunicator

__version__ = "0.1.0"

STRATEGY_NAMES = tuple(register_strategies())

__all__ = [
    "LowBitConfig",
    "ConfigError",
    "Lion",
    "LionCommunicator",
    "LowBitStrategy",
    "LowBitSetupError",
    "STRATEGY_NAMES",
    "__version__",
]
