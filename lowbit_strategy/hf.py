"""The Hugging Face ``Trainer`` front end: :class:`LowBitTrainer` and :class:`LowBitTrainerMixin`.

::

    from lowbit_strategy.hf import LowBitTrainer, LowBitTrainerMixin

    trainer = LowBitTrainer(model=model, args=args, train_dataset=data)   # was: Trainer(...)
    class MySFT(LowBitTrainerMixin, SFTTrainer): ...                       # any Trainer subclass

The public import path; the code lives with the other front ends in
:mod:`lowbit_strategy.integrations.hf`. Importing this module imports transformers and
Accelerate (``pip install "lowbit-strategy[hf]"``); the rest of ``lowbit_strategy`` never does.
"""

from lowbit_strategy.integrations.hf import (
    WARMUP_FRACTION,
    CommMeter,
    LowBitSetupError,
    LowBitTrainer,
    LowBitTrainerMixin,
    parse_optim_args,
)

__all__ = [
    "CommMeter",
    "LowBitSetupError",
    "LowBitTrainer",
    "LowBitTrainerMixin",
    "WARMUP_FRACTION",
    "parse_optim_args",
]
