"""Front ends: plain DDP (:mod:`.ddp`), Lightning (:mod:`.lightning`). They drive every
algorithm through the registry (:mod:`lowbit_strategy.algorithms`) and hold no
per-algorithm code. Only :mod:`.lightning` imports Lightning."""
