"""TurboQuant-Adam: AdamW whose momentum is synchronized as 4-bit Hadamard-rotated
Lloyd–Max codes with momentum-level error compensation ("TurboQuant-Adam", Algorithm 1).

``config.py`` its config section, ``optimizer.py`` :class:`TurboQuantAdamW`,
``communicator.py`` the per-bucket collective and its rank-local state (errors, scale
EMAs), ``algorithm.py`` the registry entry. The codec is
:class:`lowbit_strategy.codecs.TurboQuantCodec`, the collectives
:mod:`lowbit_strategy.collectives.turboquant`.
"""

from lowbit_strategy.algorithms.turboquant.algorithm import ALGORITHM, TurboQuantSync
from lowbit_strategy.algorithms.turboquant.communicator import TurboQuantCommunicator, choose_form
from lowbit_strategy.algorithms.turboquant.config import TurboQuantConfig
from lowbit_strategy.algorithms.turboquant.optimizer import TurboQuantAdamW

__all__ = [
    "ALGORITHM",
    "TurboQuantAdamW",
    "TurboQuantCommunicator",
    "TurboQuantConfig",
    "TurboQuantSync",
    "choose_form",
]
