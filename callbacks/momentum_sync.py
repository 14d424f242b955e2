"""MomentumSync: average selected momenta across ranks every k steps (Lion Cub Sec. 5).

Momentum diverges across ranks mainly in the input embedding and the output head
(Fig. 6); averaging those every 10 steps recovers the convergence of full sync at a
fraction of its traffic (Fig. 5, 8).

The callback is a way of setting ``LowBitConfig.lion.momentum_sync_every`` / ``_layers``
from the ``Trainer``'s callback list: in ``setup`` (before the strategy builds its
synchronization) it writes them into the :class:`~lowbit_strategy.LowBitStrategy`'s
config, which stays the one source of truth — so ``auto`` plans with momentum sync in
mind, and the optimizer counts the steps. With any other strategy it warns and does
nothing (without a low-bit strategy there is nothing rank-local to sync).
"""

from __future__ import annotations

from collections.abc import Sequence

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lowbit_strategy import Lion
from lowbit_strategy.validation import check_int


class MomentumSync(pl.Callback):
    """``every``: optimizer steps between syncs (>= 1). ``layers``: ``"auto"`` (input
    embedding and output head, tied weights once), ``"all"``, or parameter-name patterns
    (fnmatch; each must match)."""

    def __init__(self, every: int = 10, layers: str | Sequence[str] = "auto"):
        check_int("MomentumSync", "every", every, 1)
        self.every = every
        self.layers = layers if isinstance(layers, str) else tuple(layers)
        self._optimizers: list[Lion] = []

    def setup(self, trainer, pl_module, stage: str) -> None:
        strategy = trainer.strategy
        configure = getattr(strategy, "configure_lowbit", None)
        if configure is None or strategy.lowbit_config.algorithm != "lion":
            rank_zero_warn(
                "MomentumSync does nothing here: it needs a LowBitStrategy running Lion Cub "
                "(strategy='lowbit_lion' and family)"
            )
            return
        configure(momentum_sync_every=self.every, momentum_sync_layers=self.layers)

    def on_train_start(self, trainer, pl_module) -> None:
        self._optimizers = [o for o in trainer.optimizers if isinstance(o, Lion)]

    @property
    def syncs(self) -> int:
        """Momentum syncs the optimizers of the current (or last) run performed."""
        return max((o.momentum_syncs for o in self._optimizers), default=0)
