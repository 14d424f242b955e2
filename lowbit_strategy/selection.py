"""Which gradients BitDP quantizes: selective compression (BitDP Sec. 3.1.1, Algorithm 1).

BitDP quantizes "all linear layers in the model, excluding biases, embedding layers, and
normalization layers": the weight matrices carry ~99.6 % of the gradient volume (Table 1),
while quantizing biases, LayerNorm or embeddings made training diverge (Table 2: "FG w/
bias", "FG w/Embd") or cost accuracy ("FG w/LN").

Default rule, per parameter (deterministic, independent of module order):

1. it is the ``weight`` of at least one :class:`torch.nn.Linear` (subclasses included,
   e.g. ``MultiheadAttention.out_proj``) or of a Hugging Face ``Conv1D`` (GPT-2's
   attention and MLP projections: a linear layer whose weight is stored ``in x out``,
   recognized by class name and ``nf`` so transformers is not imported), is floating
   point and 2-D, **and**
2. it is not a parameter of any :class:`torch.nn.Embedding` / :class:`torch.nn.EmbeddingBag`.
   A GPT-style ``lm_head`` whose weight is tied to the token embedding is the same
   Parameter as the embedding's, so it stays full precision, **and**
3. it is not the *output embedding*: the last Linear (in module order) whose weight has the
   shape of an embedding's weight (vocab x d), i.e. an untied Llama-style ``lm_head``. Its
   rows are per-token vectors like the input embedding's, and BitDP's ablation (Table 2,
   "2-bit with embeddings" diverges) argues for keeping it exact too.

Channels are the output features: the rows of a Linear weight, the *columns* of a
``Conv1D`` weight (``ParamInfo.transposed``; the hook encodes its transpose).

Everything else — biases, norm weights (LayerNorm, RMSNorm, ...), embeddings, convolution
or custom parameters, ``MultiheadAttention.in_proj_weight`` — is averaged at full precision.
Pass ``quantize=[...]`` patterns to quantize such a head anyway.

Overrides, by :func:`fnmatch.fnmatchcase` patterns over qualified parameter names (names
relative to the model given to :func:`classify`; a DDP or ``torch.compile`` wrapper is
unwrapped first; a tied parameter matches if *any* of its names matches):

* ``quantize``: when given, it replaces the default rule — exactly the matching parameters
  are quantized (rows = dim 0, a 1-D parameter is one row; never a scalar or an integer
  tensor);
* ``exclude``: matching parameters are never quantized; it wins over ``quantize``.
"""
from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass
from typing import Iterable

from torch import nn

EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


@dataclass(frozen=True)
class ParamInfo:
    """What :func:`classify` decided for one parameter, and why."""

    names: tuple[str, ...]
    owners: tuple[str, ...]
    shape: tuple[int, ...]
    quantized: bool
    reason: str
    transposed: bool = False  # weight stored in x out (HF Conv1D): channels are its columns

    @property
    def name(self) -> str:
        return self.names[0]


def patterns(field: str, value: str | Iterable[str] | None) -> tuple[str, ...] | None:
    """Normalize a pattern argument to a tuple of strings (None stays None)."""
    if value is None:
        return None
    try:
        out = (value,) if isinstance(value, str) else tuple(value)
    except TypeError:
        out = None
    if out is None or not all(isinstance(v, str) and v for v in out):
        raise ValueError(
            f"{field}: got {value!r}; pass fnmatch patterns over parameter names as a "
            "string or a list of non-empty strings, e.g. ['*.attn.*.weight']"
        )
    return out


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
    return (type(module).__name__ == "Conv1D" and isinstance(w, nn.Parameter) and w.dim() == 2
            and getattr(module, "nf", None) == w.shape[1])


def _linear_weight(module: nn.Module, attr: str) -> bool:
    return attr == "weight" and (isinstance(module, nn.Linear) or is_conv1d(module))


def _conv1d_weight(owners: list[tuple[nn.Module, str]]) -> bool:
    return any(attr == "weight" and is_conv1d(m) for m, attr in owners)


def _output_embedding(model: nn.Module) -> int | None:
    """id of the last Linear weight shaped like an embedding's weight (rule 3), if any."""
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, EMBEDDINGS)}
    found = None
    for m in model.modules():
        if isinstance(m, nn.Linear) and tuple(m.weight.shape) in shapes:
            found = id(m.weight)
    return found


def _default(p: nn.Parameter, owners: list[tuple[nn.Module, str]], output_embedding: int | None) -> tuple[bool, str]:
    if any(isinstance(m, EMBEDDINGS) for m, _ in owners):
        return False, "embedding (tied or not) stays full precision"
    if id(p) == output_embedding:
        return False, "output embedding (last linear shaped like the input embedding) stays full precision"
    if not any(_linear_weight(m, attr) for m, attr in owners):
        if any(attr == "bias" for _, attr in owners):
            return False, "bias stays full precision"
        return False, "not a linear weight"
    if p.dim() != 2 or not p.is_floating_point():
        return False, "linear weight that is not a floating 2-D matrix"
    if _conv1d_weight(owners):
        return True, "linear weight (Conv1D, in x out: channels are columns)"
    return True, "linear weight"


def classify(
    model: nn.Module,
    quantize: Iterable[str] | str | None = None,
    exclude: Iterable[str] | str | None = None,
) -> dict[int, ParamInfo]:
    """Decide, for every parameter of ``model``, whether BitDP quantizes its gradient
    (frozen ones too, so unfreezing later needs no new attach). Keyed by ``id(parameter)``:
    the objects DDP's ``GradBucket.parameters()`` returns. Patterns that match nothing
    warn (likely a typo); selecting nothing at all warns too.
    """
    quantize, exclude = patterns("quantize", quantize), patterns("exclude", exclude)
    model = unwrap(model)
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            key = id(p)
            params[key] = p
            owners.setdefault(key, []).append((mod, attr))
            full = f"{mod_name}.{attr}" if mod_name else attr
            if full not in names.setdefault(key, []):
                names[key].append(full)
    used: set[str] = set()
    output_embedding = _output_embedding(model)

    def hit(pats: tuple[str, ...] | None, key: int) -> bool:
        found = [pt for pt in pats or () for n in names[key] if fnmatch.fnmatchcase(n, pt)]
        used.update(found)
        return bool(found)

    out: dict[int, ParamInfo] = {}
    for key, p in params.items():
        excluded, matched = hit(exclude, key), hit(quantize, key)
        if excluded:
            q, why = False, "matches exclude"
        elif quantize is not None:
            q = matched and p.is_floating_point() and p.dim() >= 1
            why = "matches quantize" if q else ("not a floating tensor" if matched else "matches no quantize pattern")
        else:
            q, why = _default(p, owners[key], output_embedding)
        transposed = q and _conv1d_weight(owners[key])
        out[key] = ParamInfo(
            tuple(names[key]), tuple(type(m).__name__ for m, _ in owners[key]), tuple(p.shape), q, why, transposed
        )
    example = next(iter(names.values()), ["?"])[0]
    for pt in (exclude or ()) + (quantize or ()):
        if pt not in used:
            warnings.warn(f"BitDP pattern {pt!r} matches no parameter name (names look like {example!r})", stacklevel=3)
    if out and not any(i.quantized for i in out.values()):
        warnings.warn("BitDP selects no parameter to quantize: every gradient goes at full precision", stacklevel=3)
    return out
