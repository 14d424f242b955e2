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

from lowbit_strategy.section import Section
from lowbit_strategy.validation import ConfigError, as_bool, as_int, is_none


@dataclass(frozen=True)
class _OneBitSection(Section):
    """overlap: in the compression stage, start each fused buffer's compressed momentum
        allreduce from the communication hook, during backward (True), or synchronize in
        ``optimizer.step()`` (False). Same result bit for bit. The Lightning strategy turns
        it off itself when gradients change after backward (gradient clipping), and says
        so once. During warm-up the hook averages the gradients, as DDP does, either way.
    scale_block: elements that share one 1-bit scale (a multiple of 8), on the workers and
        on the servers; blocks never straddle the P server chunks, so a block larger than a
        chunk still means one scale per chunk. None: one scale per fused buffer on each
        worker and one per server chunk, as in the papers. A momentum buffer fused over
        layers whose magnitudes differ by orders of magnitude loses most of its small layers
        to one shared scale (1-bit LAMB Sec. 4.3): on the GPT example, one scale for the
        whole model ended 7 % above AdamW's loss and 64k-element scales 0.7 %. Costs 4 bytes
        per block per peer and phase (0.1 % at the default).
    """

    overlap: bool = True
    scale_block: int | None = 32768

    def __post_init__(self) -> None:
        self._set("overlap", as_bool(self.field_name("overlap"), self.overlap))
        if not is_none(self.scale_block):
            block = as_int(self.field_name("scale_block"), self.scale_block, 8)
            if block % 8:
                raise ConfigError(
                    self.field_name("scale_block"),
                    self.scale_block,
                    "a multiple of 8 (whole bytes of sign bits), or None",
                )
            self._set("scale_block", block)
        else:
            self._set("scale_block", None)


@dataclass(frozen=True)
class OneBitAdamConfig(_OneBitSection):
    __doc__ = "1-bit Adam (``lowbit_strategy.OneBitAdam``).\n\n" + (_OneBitSection.__doc__ or "")
    name: ClassVar[str] = "onebit_adam"


@dataclass(frozen=True)
class OneBitLambConfig(_OneBitSection):
    __doc__ = "1-bit LAMB (``lowbit_strategy.OneBitLamb``).\n\n" + (_OneBitSection.__doc__ or "")
    name: ClassVar[str] = "onebit_lamb"
