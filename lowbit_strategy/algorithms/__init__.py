"""The algorithm registry: one package per paper, one :class:`~.base.Algorithm` entry each.

Front ends (plain DDP, Lightning, Accelerate) look an algorithm up here by
``LowBitConfig.algorithm`` and drive it through :class:`~.base.Sync`; they never name an
algorithm themselves. Adding one: a package ``algorithms/<name>/`` with its config section,
optimizer and/or hook, selection and ``ALGORITHM`` entry, and one line below.
"""

from __future__ import annotations

from lowbit_strategy.algorithms.base import Algorithm, LowBitSetupError, Sync
from lowbit_strategy.section import SHARED_FIELDS

REGISTRY: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` to :data:`REGISTRY` (its section's fields may not shadow shared ones)."""
    clash = set(algorithm.section.fields()) & set(SHARED_FIELDS)
    if clash or algorithm.section.name != algorithm.name:
        raise ValueError(
            f"algorithm {algorithm.name!r}: section must be named {algorithm.name!r} and not "
            f"redefine shared fields {sorted(clash)}"
        )
    REGISTRY[algorithm.name] = algorithm
    return algorithm


def get(name: str) -> Algorithm:
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"no algorithm {name!r}; registered: {', '.join(REGISTRY)}") from None


from lowbit_strategy.algorithms import bitdp, demo, diloco, lion_cub, onebit, turboquant  # noqa: E402  (they import the names above)

register(lion_cub.ALGORITHM)
register(bitdp.ALGORITHM)
register(onebit.ADAM)
register(onebit.LAMB)
register(turboquant.ALGORITHM)
register(diloco.ALGORITHM)
register(demo.ALGORITHM)

__all__ = ["Algorithm", "LowBitSetupError", "REGISTRY", "Sync", "get", "register"]
