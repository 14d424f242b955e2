"""Swap a model's ``nn.Linear`` layers for ``TurboQuantLinear`` (and back), in place.

Which layers (:func:`compress_activations`):

* eligible: modules whose type is exactly ``nn.Linear`` (a subclass may compute more than
  ``F.linear``; ``MultiheadAttention.out_proj`` is never called through its forward), plus
  layers already swapped (left as they are);
* default (``include=None``): every eligible layer but the **output head**
  (:func:`lowbit_strategy.roles.output_head`: the last linear shaped like an embedding,
  else the last linear). The head's input is small next to the rest and its weight
  gradient feeds the embedding when tied, so it keeps the exact input;
* ``include``: :func:`fnmatch.fnmatchcase` patterns over qualified *module* names (e.g.
  ``"blocks.*.fc"``); the layers matching any, the head too if a pattern names it;
* ``exclude``: patterns removed from that selection.

As everywhere in this package, a pattern that matches no linear layer is an error (a typo
would otherwise silently compress nothing). A layer reachable under several names (shared)
is selected if any of its names is included and none excluded, and replaced under all.

The swap keeps the Parameter objects (:meth:`TurboQuantLinear.from_linear`) and the
modules' order, so ``parameters()``, ``state_dict()`` keys, an optimizer built before or
after, and checkpoints are the same with and without it.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Sequence

from torch import nn

from lowbit_strategy.nn.linear import TurboQuantLinear, check_layer_settings
from lowbit_strategy.roles import check_patterns, output_head, unwrap

logger = logging.getLogger(__name__)

__all__ = ["compress_activations", "decompress_activations", "select_linears"]


def _names_by_module(model: nn.Module) -> dict[int, tuple[nn.Module, list[str]]]:
    out: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if name:
            out.setdefault(id(m), (m, []))[1].append(name)
    return out


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in model.modules():
        for key, child in list(parent._modules.items()):
            if child is old:
                parent._modules[key] = new  # same key, same position: module order unchanged


def select_linears(
    model: nn.Module,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    *,
    field: str = "compress_activations",
) -> list[tuple[str, nn.Linear]]:
    """``(first name, module)`` of the layers :func:`compress_activations` would compress
    (already swapped ones included), in module order; see the module doc for the rules.
    ``field`` names the caller in errors."""
    model = unwrap(model)
    inc = check_patterns(f"{field}: include", include)
    exc = check_patterns(f"{field}: exclude", exclude)
    linears = [
        (m, names)
        for m, names in _names_by_module(model).values()
        if type(m) is nn.Linear or isinstance(m, TurboQuantLinear)
    ]
    all_names = [n for _, names in linears for n in names]

    def matching(patterns: tuple[str, ...], names: Iterable[str], used: set[str]) -> bool:
        hits = [p for p in patterns for n in names if fnmatch.fnmatchcase(n, p)]
        used.update(hits)
        return bool(hits)

    used_inc: set[str] = set()
    used_exc: set[str] = set()
    head = output_head(model)
    chosen = []
    for m, names in linears:
        selected = matching(inc, names, used_inc) if inc else m is not head
        if exc and matching(exc, names, used_exc):
            selected = False
        if selected:
            chosen.append((names[0], m))
    for what, patterns, used in (("include", inc, used_inc), ("exclude", exc, used_exc)):
        for p in patterns or ():
            if p not in used:
                shown = ", ".join(all_names[:6]) or "(the model has no nn.Linear layer)"
                raise ValueError(
                    f"{field}: {what} pattern {p!r} matches no nn.Linear module name (names look like: {shown}, ...); "
                    "patterns are fnmatch patterns over module names such as 'blocks.*.fc'; fix or remove it"
                )
    return chosen


def compress_activations(
    model: nn.Module,
    include: str | Sequence[str] | None = None,
    exclude: str | Sequence[str] | None = None,
    bits: int = 4,
    block: int | None = None,
    seed: int = 0,
) -> list[str]:
    """Replace the selected ``nn.Linear`` layers of ``model`` (in place; a DDP or
    ``torch.compile`` wrapper is looked through) by :class:`TurboQuantLinear` layers with the
    same Parameter objects; returns the names of the layers it replaced (layers already
    replaced are left alone and not listed). Do it before building the optimizer or
    wrapping the model, as with any change of modules (the parameters are the same
    objects, so an optimizer built earlier still works). See :class:`TurboQuantLinear` for
    ``bits``, ``block`` and ``seed``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"compress_activations: model must be an nn.Module, got {type(model).__name__}")
    check_layer_settings("compress_activations", bits, block, seed)  # here, whatever layers the model has
    root = unwrap(model)
    swapped = []
    for name, m in select_linears(root, include, exclude):
        if isinstance(m, TurboQuantLinear):
            continue
        _replace(root, m, TurboQuantLinear.from_linear(m, bits=bits, block=block, seed=seed))
        swapped.append(name)
    logger.debug("compress_activations: %d layers compressed: %s", len(swapped), swapped)
    return swapped


def decompress_activations(model: nn.Module) -> list[str]:
    """Replace every :class:`TurboQuantLinear` of ``model`` by the plain ``nn.Linear`` with
    the same Parameter objects (:meth:`TurboQuantLinear.to_linear`); returns their names."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"decompress_activations: model must be an nn.Module, got {type(model).__name__}")
    root = unwrap(model)
    restored = []
    for m, names in _names_by_module(root).values():
        if isinstance(m, TurboQuantLinear):
            _replace(root, m, m.to_linear())
            restored.append(names[0])
    return restored
