"""Front ends: plain DDP (:mod:`.ddp`) and its sharded form (:mod:`.sharded`), Lightning
(:mod:`.lightning`; sharded: :mod:`.lightning_sharded`) and Accelerate (:mod:`.accelerate`,
imported as :mod:`lowbit_strategy.accelerate`). They drive every algorithm through the
registry (:mod:`lowbit_strategy.algorithms`) and hold no per-algorithm code. Only
:mod:`.lightning` and :mod:`.lightning_sharded` import Lightning, only :mod:`.accelerate`
imports Accelerate; none is imported by ``import lowbit_strategy``."""
