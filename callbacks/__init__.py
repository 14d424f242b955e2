"""Lightning callbacks for lowbit-strategy.

A separate top-level package: it depends on :mod:`lowbit_strategy`, never the reverse.
"""

from callbacks.activation_compression import ActivationCompression
from callbacks.comm_stats import CommStats
from callbacks.divergence import DivergenceMonitor
from callbacks.momentum_sync import MomentumSync

__all__ = ["ActivationCompression", "CommStats", "DivergenceMonitor", "MomentumSync"]
