"""1-bit Adam and 1-bit LAMB: two-stage optimizers whose compression stage synchronizes
momenta with the error-compensated 1-bit allreduce ("1-bit Adam", Tang et al.,
arXiv:2102.02888; "1-bit LAMB", Li et al., arXiv:2104.06069).

``config.py`` their config sections, ``optimizer.py`` the two stages with a frozen
variance (their shared base), ``adam.py`` :class:`OneBitAdam`, ``lamb.py`` LAMB's arithmetic
and :class:`OneBitLamb` (Adam's arithmetic is :mod:`lowbit_strategy.algorithms.staged.adam`,
shared with TurboQuant-Adam), ``communicator.py`` the bucketed compressed allreduce and its
error buffers, ``algorithm.py`` the registry entries.
"""

from lowbit_strategy.algorithms.onebit.adam import OneBitAdam
from lowbit_strategy.algorithms.onebit.algorithm import ADAM, LAMB, OneBitSync
from lowbit_strategy.algorithms.onebit.communicator import OneBitCommunicator
from lowbit_strategy.algorithms.onebit.config import OneBitAdamConfig, OneBitLambConfig
from lowbit_strategy.algorithms.onebit.lamb import OneBitLamb

__all__ = [
    "ADAM",
    "LAMB",
    "OneBitAdam",
    "OneBitAdamConfig",
    "OneBitCommunicator",
    "OneBitLamb",
    "OneBitLambConfig",
    "OneBitSync",
]
