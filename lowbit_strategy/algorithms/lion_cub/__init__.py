"""Lion Cub: distributed Lion with 1-bit majority-vote and p-bit L1-quantized
synchronization of the update vector, and selective momentum sync (Lion Cub: Minimizing
Communication Overhead in Distributed Lion).

``config.py`` its config section, ``optimizer.py`` :class:`Lion`, ``communicator.py`` how
update vectors become one compressed collective per bucket, ``selection.py`` which momenta
are synchronized, ``algorithm.py`` its registry entry.
"""

from lowbit_strategy.algorithms.lion_cub.algorithm import ALGORITHM, LionSync
from lowbit_strategy.algorithms.lion_cub.communicator import LionCommunicator, Plan, resolve_mode
from lowbit_strategy.algorithms.lion_cub.config import LionConfig
from lowbit_strategy.algorithms.lion_cub.optimizer import Lion

__all__ = ["ALGORITHM", "Lion", "LionCommunicator", "LionConfig", "LionSync", "Plan", "resolve_mode"]
