"""Parameter roles and name patterns: the one rule set every algorithm selects with.

Algorithms choose parameters by *role* (Lion Cub syncs the momentum of the input
embedding and the output head, Sec. 5 / Fig. 6; BitDP quantizes linear weights but not
embeddings or the output embedding, Sec. 3.1.1) or by *name pattern* (user overrides).
The roles are defined once here:

* **linear weight**: the ``weight`` of an :class:`torch.nn.Linear` (subclasses included,
  e.g. ``MultiheadAttention.out_proj``), of a Hugging Face ``Conv1D`` (GPT-2's projections,
  weight stored ``in x out``: channels are its columns, recognized by class name and ``nf``
  so transformers is not imported), or a packed projection of
  :class:`torch.nn.MultiheadAttention` (``in_proj_weight``, ``q/k/v_proj_weight``: rows are
  output features, as in a Linear);
* **embedding**: a parameter of an :class:`torch.nn.Embedding` / ``EmbeddingBag``; the
  **input embedding** is the first such module (in module order);
* **output head**: the last linear layer (module order) whose weight is shaped like an
  embedding's weight (``vocab x d``; ``d x vocab`` for ``Conv1D``), tied or not — the
  *output embedding*; in a model with no such layer, the last linear layer.

Patterns are :func:`fnmatch.fnmatchcase` patterns over qualified parameter names relative
to the model (a DDP or ``torch.compile`` wrapper is unwrapped first); a tied parameter
matches if any of its names matches. **A pattern that matches no parameter is an error**
(a typo would otherwise silently select nothing), raised as :class:`ValueError` naming the
field, the pattern and what the names look like.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from torch import nn

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
#: nn.MultiheadAttention's own projection matrices (out_proj is a Linear)
MHA_PROJECTIONS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DistributedDataParallel / ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def is_conv1d(module: nn.Module) -> bool:
    """A Hugging Face ``transformers.pytorch_utils.Conv1D`` (a linear layer, weight ``in x
    out``), recognized without importing transformers."""
    w = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(w, nn.Parameter)
        and w.dim() == 2
        and getattr(module, "nf", None) == w.shape[1]
    )


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def is_linear_weight(module: nn.Module, attr: str) -> bool:
    """Whether ``module.<attr>`` is a linear weight (see the module doc)."""
    if attr == "weight" and is_linear(module):
        return True
    return isinstance(module, nn.MultiheadAttention) and attr in MHA_PROJECTIONS


@dataclass(frozen=True)
class Owner:
    """A parameter as seen from one module owning it."""

    name: str  # qualified name, e.g. "blocks.0.attn.in_proj_weight"
    module: nn.Module
    attr: str


def owners(model: nn.Module) -> dict[int, list[Owner]]:
    """id(parameter) -> every (name, module, attribute) owning it, frozen ones included,
    in module order (tied parameters have several)."""
    out: dict[int, list[Owner]] = {}
    for mod_name, mod in unwrap(model).named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            listed = out.setdefault(id(p), [])
            if all(o.name != name for o in listed):
                listed.append(Owner(name, mod, attr))
    return out


def input_embedding(model: nn.Module) -> nn.Module | None:
    """The first Embedding / EmbeddingBag in module order, if any."""
    return next((m for m in unwrap(model).modules() if isinstance(m, EMBEDDINGS)), None)


def output_embedding(model: nn.Module) -> nn.Module | None:
    """The last linear layer whose weight is shaped like an embedding's (an LM head)."""
    model = unwrap(model)
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, EMBEDDINGS)}
    found = None
    for m in model.modules():
        if is_linear(m):
            shape = tuple(cast(nn.Parameter, m.weight).shape)  # a Linear's or Conv1D's weight
            if (shape[::-1] if is_conv1d(m) else shape) in shapes:
                found = m
    return found


def output_head(model: nn.Module) -> nn.Module | None:
    """The output embedding, or (a model without one) the last linear layer."""
    head = output_embedding(model)
    if head is None:
        head = next((m for m in reversed(list(unwrap(model).modules())) if is_linear(m)), None)
    return head


def input_output_params(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of the input embedding and the output head, a tied weight once.

    Without an embedding the first module owning parameters stands for the input; without
    a linear layer, the last one stands for the head.
    """
    model = unwrap(model)
    modules = [m for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    if not modules:
        return []
    first = input_embedding(model) or modules[0]
    last = output_head(model) or modules[-1]
    out: list[nn.Parameter] = []
    for p in [*first.parameters(recurse=False), *last.parameters(recurse=False)]:
        if p.requires_grad and all(p is not q for q in out):
            out.append(p)
    return out


def check_patterns(field: str, value: str | Iterable[str] | None) -> tuple[str, ...] | None:
    """Normalize a pattern argument to a tuple of strings (None stays None)."""
    if value is None:
        return None
    try:
        out = (value,) if isinstance(value, str) else tuple(value)
    except TypeError:
        out = None
    if not out or not all(isinstance(v, str) and v for v in out):
        raise ValueError(
            f"{field}: got {value!r}; pass fnmatch patterns over parameter names as a "
            "string or a list of non-empty strings, e.g. ['*.attn.*.weight']"
        )
    return out


class PatternSet:
    """Patterns of one field, matched against parameters' names; remembers which matched,
    so :meth:`check_all_used` can name a pattern that matched nothing."""

    def __init__(self, field: str, patterns: Sequence[str] | None):
        self.field = field
        self.patterns = tuple(patterns or ())
        self.used: set[str] = set()

    def __bool__(self) -> bool:
        return bool(self.patterns)

    def matches(self, names: Iterable[str]) -> bool:
        names = list(names)
        hits = [pt for pt in self.patterns for n in names if fnmatch.fnmatchcase(n, pt)]
        self.used.update(hits)
        return bool(hits)

    def check_all_used(self, example_names: Sequence[str]) -> None:
        for pt in self.patterns:
            if pt not in self.used:
                shown = ", ".join(example_names[:6])
                raise ValueError(
                    f"{self.field}: pattern {pt!r} matches no parameter name (names look like: "
                    f"{shown}, ...); fix the pattern or remove it"
                )


def select_params(model: nn.Module, layers: str | Sequence[str], field: str = "layers") -> list[nn.Parameter]:
    """Trainable parameters for ``layers``: ``"auto"`` (:func:`input_output_params`),
    ``"all"``, ``"none"``, or patterns (each must match, see the module doc)."""
    if layers == "none":
        return []
    if layers == "auto":
        return input_output_params(model)
    named = owners(model)
    params = {id(p): p for p in unwrap(model).parameters()}
    if layers == "all":
        return [p for p in params.values() if p.requires_grad]
    pats = PatternSet(field, check_patterns(field, layers))
    out = [params[k] for k, own in named.items() if k in params and pats.matches(o.name for o in own)]
    pats.check_all_used([own[0].name for own in named.values()])
    return [p for p in out if p.requires_grad]


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> its first name in ``model`` (for logging per layer)."""
    return {k: own[0].name for k, own in owners(model).items()}
