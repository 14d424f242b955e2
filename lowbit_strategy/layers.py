"""Choosing parameters by role: which momenta selective synchronization averages.

Lion Cub Sec. 5 / Fig. 6: momentum diverges across ranks almost only in the input
embedding and the output head (where the differing data enters), so syncing just those
every k steps recovers the convergence of syncing everything.
"""
from __future__ import annotations

import fnmatch
from typing import Sequence

from torch import nn


def _own_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters(recurse=False) if p.requires_grad]


def input_output_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the input embedding and of the output head.

    Input: the first ``nn.Embedding`` (else the first module owning parameters). Output:
    the last ``nn.Linear`` (else the last module owning parameters). A head tied to the
    embedding shares its weight, which is listed once.
    """
    owners = [m for m in model.modules() if _own_params(m)]
    if not owners:
        return []
    first = next((m for m in owners if isinstance(m, nn.Embedding)), owners[0])
    last = next((m for m in reversed(owners) if isinstance(m, nn.Linear)), owners[-1])
    out: list[nn.Parameter] = []
    for p in _own_params(first) + _own_params(last):
        if all(p is not q for q in out):
            out.append(p)
    return out


def select_params(model: nn.Module, layers: str | Sequence[str]) -> list[nn.Parameter]:
    """Parameters for ``layers``: ``"auto"`` (:func:`input_output_params`), ``"all"``,
    ``"none"``, or fnmatch patterns over ``named_parameters()`` names. Patterns that
    match nothing raise ``ValueError`` (a typo would silently sync nothing)."""
    if layers == "none":
        return []
    if layers == "auto":
        return input_output_params(model)
    named = list(model.named_parameters())
    if layers == "all":
        return [p for _, p in named if p.requires_grad]
    if isinstance(layers, str):
        layers = (layers,)
    out: list[nn.Parameter] = []
    for pattern in layers:
        hits = [p for n, p in named if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            names = ", ".join(n for n, _ in named[:8])
            raise ValueError(f"momentum sync layer pattern {pattern!r} matches no parameter; names look like: {names}, ...")
        out.extend(p for p in hits if all(p is not q for q in out))
    return out


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in ``model`` (for logging per layer)."""
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    return names

