"""1-bit Adam's and 1-bit LAMB's sections of :class:`~lowbit_strategy.config.LowBitConfig`
(``config.onebit_adam``, ``config.onebit_lamb``).

The optimizer hyperparameters (``lr``, ``betas``, ``freeze_step``, LAMB's coefficient
bounds, ...) are the optimizer's constructor arguments, named as DeepSpeed's ``OnebitAdam``
and ``OnebitLamb`` name them, so a DeepSpeed config translates one to one; the section holds
only how the synchronization runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lowbit_strategy.config import Section
from lowbit_strategy.validation import as_bool


@dataclass(frozen=True)
class _OneBitSection(Section):
    """overlap: in the compression stage, start each DDP bucket's compressed momentum
        allreduce from the communication hook, during backward (True), or synchronize in
        ``optimizer.step()`` (False). Same result bit for bit. The Lightning strategy turns
        it off itself when gradients change after backward (gradient clipping), and says
        so once. During warm-up the hook averages the gradients, as DDP does, either way.
    """

    overlap: bool = True

    def __post_init__(self) -> None:
        self._set("overlap", as_bool(self.field_name("overlap"), self.overlap))


@dataclass(frozen=True)
class OneBitAdamConfig(_OneBitSection):
    __doc__ = "1-bit Adam (``lowbit_strategy.OneBitAdam``).\n\n" + _OneBitSection.__doc__
    name: ClassVar[str] = "onebit_adam"


@dataclass(frozen=True)
class OneBitLambConfig(_OneBitSection):
    __doc__ = "1-bit LAMB (``lowbit_strategy.OneBitLamb``).\n\n" + _OneBitSection.__doc__
    name: ClassVar[str] = "onebit_lamb"
