"""The Hugging Face Accelerate front end: :class:`LowBitAccelerator`.

::

    from lowbit_strategy.accelerate import LowBitAccelerator

    accelerator = LowBitAccelerator()      # LOWBIT_CONFIG=lowbit.yaml, LOWBIT_<FIELD>=... from the launcher
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

The public import path; the code lives with the other front ends in
:mod:`lowbit_strategy.integrations.accelerate`. Importing this module imports Accelerate
(``pip install "lowbit-strategy[accelerate]"``); the rest of ``lowbit_strategy`` never does.
"""

from lowbit_strategy.integrations.accelerate import PRECISIONS, STATE_FILE, LowBitAccelerator, LowBitSetupError

__all__ = ["LowBitAccelerator", "LowBitSetupError", "PRECISIONS", "STATE_FILE"]
