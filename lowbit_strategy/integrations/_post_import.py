"""Run a function once a module is imported, now if it already is.

``import lowbit_strategy`` must register the Lightning strategy names (Lightning resolves
``Trainer(strategy="lowbit_lion")`` from its registry) without importing Lightning itself,
so that plain-DDP users do not pay for it. A finder on ``sys.meta_path`` waits for
``lightning.pytorch.strategies`` and calls the registration right after that module has
executed, whichever of the two packages is imported first.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[], None]):
        self.name, self.callback, self.busy = name, callback, False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self.busy:
            return None
        self.busy = True  # let the real finders resolve it
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, callback, finder = spec.loader, self.callback, self

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)
                callback()

        spec.loader = _Loader()
        return spec


def when_imported(name: str, callback: Callable[[], None]) -> None:
    """Call ``callback()`` now if module ``name`` is imported, else right after it is."""
    if name in sys.modules:
        callback()
        return
    for finder in sys.meta_path:
        if isinstance(finder, _Finder) and finder.name == name:
            finder.callback = callback
            return
    sys.meta_path.insert(0, _Finder(name, callback))
