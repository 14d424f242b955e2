"""lowbit-strategy: data-parallel training with 4-32x fewer bytes on the wire.

Public API. Importing this package touches no CUDA and compiles nothing (safe before a
notebook's fork).
"""
from lowbit_strategy.config import ConfigError, LowBitConfig

__version__ = "0.1.0"

__all__ = ["LowBitConfig", "ConfigError", "__version__"]
