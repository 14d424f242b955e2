"""Lion Cub: distributed Lion with 1-bit majority-vote and p-bit L1-quantized
synchronization of the update vector, and selective momentum sync (Lion Cub: Minimizing
Communication Overhead in Distributed Lion).

``config.py`` its config section, ``optimizer.py`` :class:`Lion`, ``mode.py`` which mode and
lanes a bucket uses (``auto`` by the cost model), ``communicator.py`` how update vectors
become one compressed collective per bucket, ``synced_momenta.py`` which momenta are synchronized,
``algorithm.py`` its registry entry.
"""

from lowbit_strategy import _moved
from lowbit_strategy.algorithms.lion_cub.algorithm import ALGORITHM, LionSync
from lowbit_strategy.algorithms.lion_cub.communicator import LionCommunicator
from lowbit_strategy.algorithms.lion_cub.config import LionConfig
from lowbit_strategy.algorithms.lion_cub.mode import SyncMode, auto_candidates, measure_codec_seconds, resolve_mode
from lowbit_strategy.algorithms.lion_cub.optimizer import Lion

__all__ = [
    "ALGORITHM",
    "Lion",
    "LionCommunicator",
    "LionConfig",
    "LionSync",
    "SyncMode",
    "auto_candidates",
    "measure_codec_seconds",
    "resolve_mode",
]

#: ``Plan`` was renamed ``SyncMode`` (0.3), still served with a warning
__getattr__ = _moved.attribute_aliases(__name__, {"Plan": "lowbit_strategy.algorithms.lion_cub.mode.SyncMode"})
