"""DeMo: decoupled momentum with top-k DCT coefficients on the wire ("DeMo: Decoupled Momentum
Optimization", Peng, Quesnelle, Kingma, arXiv:2411.19870)."""

from lowbit_strategy.algorithms.demo.algorithm import ALGORITHM, DeMoSync
from lowbit_strategy.algorithms.demo.config import DeMoConfig
from lowbit_strategy.algorithms.demo.optimizer import DeMo

__all__ = ["ALGORITHM", "DeMo", "DeMoConfig", "DeMoSync"]
