"""MomentumSync: average selected momenta across ranks every k steps (Lion Cub Sec. 5).

Momentum diverges across ranks mainly in the input embedding and the output head
(Fig. 6); averaging those every 10 steps recovers the convergence of full sync at a
fraction of its traffic (Fig. 5, 8). Works with every :class:`lowbit_strategy.Lion`
returned by ``configure_optimizers``; a no-op on a single rank.
"""
from __future__ import annotations

from typing import Sequence

import lightning.pytorch as pl

from lowbit_strategy import Lion
from lowbit_strategy.algorithms.lion_cub.selection import momentum_sync_params


class MomentumSync(pl.Callback):
    """``every``: steps between syncs (>= 1). ``layers``: ``"auto"`` (input embedding and
    output head, tied weights once), ``"all"``, or parameter-name patterns (fnmatch)."""

    def __init__(self, every: int = 10, layers: str | Sequence[str] = "auto"):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"MomentumSync: every must be an int >= 1, got {every!r}")
        self.every = every
        self.layers = layers
        self._params: list = []
        self._last_step = 0
        self.syncs = 0

    def on_train_start(self, trainer, pl_module) -> None:
        self._params = momentum_sync_params(pl_module, self.layers, field="MomentumSync.layers")
        self._last_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # no optimizer step in this batch (gradient accumulation)
        self._last_step = step
        if step % self.every:
            return
        for opt in trainer.optimizers:
            if isinstance(opt, Lion):
                opt.sync_momentum(self._params)
        self.syncs += 1
