"""Front ends: plain DDP (:mod:`.ddp`), Lightning (:mod:`.lightning`) and Accelerate
(:mod:`.accelerate`, imported as :mod:`lowbit_strategy.accelerate`). They drive every
algorithm through the registry (:mod:`lowbit_strategy.algorithms`) and hold no
per-algorithm code. Only :mod:`.lightning` imports Lightning, only :mod:`.accelerate`
imports Accelerate; neither is imported by ``import lowbit_strategy``."""
