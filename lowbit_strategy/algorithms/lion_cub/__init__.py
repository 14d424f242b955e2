"""Lion Cub: distributed Lion with 1-bit majority-vote and p-bit L1-quantized
synchronization of the update vector, and selective momentum sync (Lion Cub: Minimizing
Communication Overhead in Distributed Lion).

``config.py`` its config section, ``optimizer.py`` :class:`Lion`, ``plan.py`` which mode and
lanes a bucket uses (``auto`` by the cost model), ``communicator.py`` how update vectors
become one compressed collective per bucket, ``selection.py`` which momenta are synchronized,
``algorithm.py`` its registry entry.
"""

from lowbit_strategy.algorithms.lion_cub.algorithm import ALGORITHM, LionSync
from lowbit_strategy.algorithms.lion_cub.communicator import LionCommunicator
from lowbit_strategy.algorithms.lion_cub.config import LionConfig
from lowbit_strategy.algorithms.lion_cub.optimizer import Lion
from lowbit_strategy.algorithms.lion_cub.plan import Plan, auto_candidates, measure_codec_seconds, resolve_mode

__all__ = [
    "ALGORITHM",
    "Lion",
    "LionCommunicator",
    "LionConfig",
    "LionSync",
    "Plan",
    "auto_candidates",
    "measure_codec_seconds",
    "resolve_mode",
]
