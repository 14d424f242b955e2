"""Optimizers whose step is the synchronization point."""
from lowbit_strategy.optim.communicator import LionCommunicator, Plan, resolve_mode
from lowbit_strategy.optim.lion import Lion

__all__ = ["Lion", "LionCommunicator", "Plan", "resolve_mode"]
