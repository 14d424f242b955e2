"""1-bit Adam and 1-bit LAMB: two-stage optimizers whose compression stage synchronizes
momenta with the error-compensated 1-bit allreduce ("1-bit Adam", Tang et al.,
arXiv:2102.02888; "1-bit LAMB", Li et al., arXiv:2104.06069).

``config.py`` their config sections, ``update.py`` the per-parameter arithmetic,
``optimizer.py`` :class:`OneBitAdam` and :class:`OneBitLamb`, ``communicator.py`` the
bucketed compressed allreduce and its error buffers, ``algorithm.py`` the registry entries.
"""
from lowbit_strategy.algorithms.onebit.algorithm import ADAM, LAMB, OneBitSync
from lowbit_strategy.algorithms.onebit.communicator import OneBitCommunicator
from lowbit_strategy.algorithms.onebit.config import OneBitAdamConfig, OneBitLambConfig
from lowbit_strategy.algorithms.onebit.optimizer import OneBitAdam, OneBitLamb

__all__ = ["ADAM", "LAMB", "OneBitAdam", "OneBitAdamConfig", "OneBitCommunicator", "OneBitLamb",
           "OneBitLambConfig", "OneBitSync"]
