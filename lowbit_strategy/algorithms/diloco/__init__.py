"""DiLoCo and Streaming DiLoCo: local updates with a compressed outer sync ("DiLoCo:
Distributed Low-Communication Training of Language Models", arXiv:2311.08105; "Streaming
DiLoCo with overlapping communication", arXiv:2501.18512).

``config.py`` its config section, ``fragments.py`` which parameters sync together and when,
``exchange.py`` the compressed mean of the pseudo-gradients, ``outer.py`` the global weights
and the outer Nesterov SGD, ``algorithm.py`` its :class:`~..base.Sync` and registry entry.
"""

from lowbit_strategy.algorithms.diloco.algorithm import ALGORITHM, DiLoCoSync
from lowbit_strategy.algorithms.diloco.config import DiLoCoConfig

__all__ = ["ALGORITHM", "DiLoCoConfig", "DiLoCoSync"]
