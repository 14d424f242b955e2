"""Old import paths of modules that moved keep working, with a ``DeprecationWarning``.

``import lowbit_strategy.collectives.cost_model`` (or ``from lowbit_strategy.collectives
import cost_model``) returns the module at its new home, :mod:`lowbit_strategy.pricing.flat`,
the same module object, so its state and a test's monkeypatch are shared whichever name was
used. A meta-path finder answers only the names in :data:`MOVED`, so the old folder holds no
stub files and nothing new can be added under an old name. Installed by the package root.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import FrameType

#: old module path -> new module path (0.3: pricing left ``collectives/``; modules renamed for
#: what they hold)
MOVED = {
    "lowbit_strategy.collectives.cost_model": "lowbit_strategy.pricing.flat",
    "lowbit_strategy.collectives.cost_model_nodes": "lowbit_strategy.pricing.nodes",
    "lowbit_strategy.collectives.cost_model_sharded": "lowbit_strategy.pricing.sharded",
    "lowbit_strategy.collectives.cost_model_world": "lowbit_strategy.pricing.world",
    "lowbit_strategy.collectives.link_probe": "lowbit_strategy.pricing.link_probe",
    "lowbit_strategy.collectives.calibration": "lowbit_strategy.pricing.calibration",
    "lowbit_strategy.selection": "lowbit_strategy.roles",
    "lowbit_strategy.algorithms.lion_cub.selection": "lowbit_strategy.algorithms.lion_cub.synced_momenta",
    "lowbit_strategy.algorithms.bitdp.selection": "lowbit_strategy.algorithms.bitdp.quantized_params",
    "lowbit_strategy.algorithms.lion_cub.plan": "lowbit_strategy.algorithms.lion_cub.mode",
    "lowbit_strategy.algorithms.turboquant.plan": "lowbit_strategy.algorithms.turboquant.form",
}


def warn_moved(old: str, new: str) -> None:
    """The deprecation, attributed to the first frame outside the import machinery and a
    module's ``__getattr__`` (the importer's line, so Python's default filters show it where
    ``__main__`` imports)."""
    frame: FrameType | None = sys._getframe(1)
    level = 2  # stacklevel 2: warn_moved's caller
    while frame is not None and _skipped(frame):
        # warnings.warn steps over the import system's frames itself: count only the others
        level += not _import_system(frame)
        frame = frame.f_back
    warnings.warn(
        f"{old} moved to {new}; import it from there (the old path will be removed in a later release)",
        DeprecationWarning,
        stacklevel=level,
    )


def attribute_aliases(module: str, renamed: dict[str, str]):
    """A module-level ``__getattr__`` (PEP 562) serving names that moved or were renamed:
    ``renamed[old name] = "package.module.new_name"``, each with the deprecation. The new home
    is imported when the old name is first read, never at import (no import cycle)."""

    def __getattr__(name: str):
        if name in renamed:
            home, attr = renamed[name].rsplit(".", 1)
            warn_moved(f"{module}.{name}", renamed[name])
            return getattr(importlib.import_module(home), attr)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__


def _import_system(frame: FrameType) -> bool:
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name  # as warnings.warn tells them


def _skipped(frame: FrameType) -> bool:
    return _import_system(frame) or frame.f_code.co_filename == __file__ or frame.f_code.co_name == "__getattr__"


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self._specs = {}  # new name -> its own spec, which the import system overwrites

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec):
        warn_moved(spec.name, MOVED[spec.name])
        module = importlib.import_module(MOVED[spec.name])
        self._specs[module.__name__] = module.__spec__  # the import system writes the alias's over it next
        return module

    def exec_module(self, module):
        module.__spec__ = self._specs[module.__name__]  # the module keeps its own name, spec and loader


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (re-importing the package does not add another)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())  # first: it answers only the old names, whatever else is installed
