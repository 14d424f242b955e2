"""The Hugging Face Accelerate front end: :class:`LowBitAccelerator`.

::

    from lowbit_strategy.accelerate import LowBitAccelerator

    accelerator = LowBitAccelerator()      # LOWBIT_CONFIG=lowbit.yaml, LOWBIT_<FIELD>=... from the launcher
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

Importing this package imports Accelerate (``pip install "lowbit-strategy[accelerate]"``);
the rest of ``lowbit_strategy`` never does.
"""
from lowbit_strategy.accelerate.accelerator import PRECISIONS, STATE_FILE, LowBitAccelerator, LowBitSetupError

__all__ = ["LowBitAccelerator", "LowBitSetupError", "PRECISIONS", "STATE_FILE"]
