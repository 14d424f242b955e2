"""lowbit-strategy: data-parallel training with 4-32x fewer bytes on the wire.

The public API::

    from lowbit_strategy import LowBitConfig, LowBitStrategy, Lion, BitDPState, bitdp_hook, attach

``import lowbit_strategy`` registers the Lightning strategy names (``lowbit_lion`` and
family, and the sharded ``lowbit_lion_fsdp`` and family) without importing Lightning: they
are registered the moment ``lightning.pytorch`` is imported, before or after this package.
:class:`LowBitStrategy` and :class:`LowBitFSDPStrategy` load Lightning when first used.
Importing touches no CUDA and compiles nothing (safe before a notebook's fork);
re-importing re-registers harmlessly.
"""

from lowbit_strategy import (
    _moved,
    nn,  # noqa: E402  lowbit_strategy.nn.TurboQuantLinear, compress_activations (torch only)
)
from lowbit_strategy.algorithms import REGISTRY as ALGORITHMS
from lowbit_strategy.algorithms.base import LowBitSetupError, Sync
from lowbit_strategy.algorithms.bitdp import BitDPState, bitdp_hook
from lowbit_strategy.algorithms.demo import DeMo
from lowbit_strategy.algorithms.lion_cub import Lion, LionCommunicator
from lowbit_strategy.algorithms.onebit import OneBitAdam, OneBitLamb
from lowbit_strategy.algorithms.turboquant import TurboQuantAdamW
from lowbit_strategy.config import ConfigError, LowBitConfig
from lowbit_strategy.integrations._post_import import when_imported
from lowbit_strategy.integrations.ddp import attach, keep_local_gradients, load_rank_states, save_rank_states
from lowbit_strategy.integrations.sharded import attach_sharded, node_mesh, sharding_mesh, world_mesh
from lowbit_strategy.validation import ConfigMismatchError
from lowbit_strategy.version import installed_version

_moved.install()  # old import paths of moved modules keep working, with a DeprecationWarning

#: the installed distribution's version (``pyproject.toml``), read from the package metadata
__version__ = installed_version()

__all__ = [
    "ALGORITHMS",
    "BitDPState",
    "ConfigError",
    "ConfigMismatchError",
    "DeMo",
    "Lion",
    "LionCommunicator",
    "OneBitAdam",
    "OneBitLamb",
    "LowBitConfig",
    "LowBitSetupError",
    "LowBitFSDPStrategy",
    "LowBitStrategy",
    "STRATEGY_NAMES",
    "Sync",
    "TurboQuantAdamW",
    "attach",
    "attach_sharded",
    "bitdp_hook",
    "keep_local_gradients",
    "nn",
    "node_mesh",
    "sharding_mesh",
    "world_mesh",
    "load_rank_states",
    "save_rank_states",
    "__version__",
]


def _strategy_names() -> tuple[str, ...]:
    from lowbit_strategy.algorithms import REGISTRY

    suffixes = ("", "_spawn", "_notebook")  # integrations.lightning.VARIANTS, without importing Lightning
    names = [base + s for algo in REGISTRY.values() for base in algo.strategy_names for s in suffixes]
    # integrations.lightning_sharded.sharded_strategy_names: each algorithm's primary (first) name + "_fsdp"
    names += [next(iter(algo.strategy_names)) + "_fsdp" for algo in REGISTRY.values() if algo.strategy_names]
    return tuple(names)


#: every Lightning strategy name this package registers
STRATEGY_NAMES = _strategy_names()


def _register_with_lightning() -> None:
    # importing the module registers the names (at its end, so that an import of it that
    # is itself what loaded Lightning registers once it is complete)
    import lowbit_strategy.integrations.lightning  # noqa: F401
    import lowbit_strategy.integrations.lightning_sharded  # noqa: F401


def __getattr__(name: str):
    if name == "LowBitStrategy":  # loads Lightning on first use only
        from lowbit_strategy.integrations.lightning import LowBitStrategy

        return LowBitStrategy
    if name == "LowBitFSDPStrategy":
        from lowbit_strategy.integrations.lightning_sharded import LowBitFSDPStrategy

        return LowBitFSDPStrategy
    raise AttributeError(f"module 'lowbit_strategy' has no attribute {name!r}")


when_imported("lightning.pytorch.strategies", _register_with_lightning)
