"""Lightning callbacks for lowbit-strategy.

A separate top-level package: it depends on :mod:`lowbit_strategy`, never the reverse.
"""
from callbacks.comm_stats import CommStats
from callbacks.divergence import DivergenceMonitor
from callbacks.momentum_sync import MomentumSync

__all__ = ["CommStats", "DivergenceMonitor", "MomentumSync"]
