"""Which momenta Lion Cub's selective momentum sync averages (Lion Cub Sec. 5, Fig. 6).

Momentum diverges across ranks almost only in the input embedding and the output head
(where the differing data enters), so ``auto`` syncs just those; the roles and the pattern
rule (a pattern matching nothing is an error) are :mod:`lowbit_strategy.roles`'s.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from lowbit_strategy.roles import select_params

FIELD = "LowBitConfig.lion.momentum_sync_layers"


def momentum_sync_params(model: nn.Module, layers: str | Sequence[str], field: str = FIELD) -> list[nn.Parameter]:
    """The parameters whose momenta are averaged for ``layers`` (``auto``, ``all``,
    ``none`` or patterns)."""
    return select_params(model, layers, field=field)
