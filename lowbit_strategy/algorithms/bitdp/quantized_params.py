"""Which gradients BitDP quantizes: selective compression (BitDP Sec. 3.1.1, Algorithm 1).

BitDP quantizes "all linear layers in the model, excluding biases, embedding layers, and
normalization layers": the weight matrices carry ~99.6 % of the gradient volume (Table 1),
while quantizing biases, LayerNorm or embeddings made training diverge (Table 2: "FG w/
bias", "FG w/Embd") or cost accuracy ("FG w/LN").

Default rule, per parameter, with the roles of :mod:`lowbit_strategy.roles`
(deterministic, independent of the order parameters are visited in):

1. it is a *linear weight* (``nn.Linear`` and subclasses such as
   ``MultiheadAttention.out_proj``, Hugging Face ``Conv1D``, ``MultiheadAttention``'s
   ``in_proj_weight`` / ``q,k,v_proj_weight``), floating point, 2-D and non-empty, **and**
2. it is not a parameter of any embedding (a GPT-style ``lm_head`` tied to the token
   embedding is the embedding's Parameter, so it stays full precision), **and**
3. it is not the *output embedding* (an untied Llama-style ``lm_head``): its rows are
   per-token vectors like the input embedding's, and BitDP's ablation (Table 2, "2-bit with
   embeddings" diverges) argues for keeping it exact too.

Channels are the output features: the rows of a Linear weight (and of ``in_proj_weight``,
whose rows are the q, k, v outputs), the *columns* of a ``Conv1D`` weight
(``ParamInfo.transposed``; the hook encodes its transpose).

Overrides by patterns (a pattern matching nothing is an error, as everywhere):
``quantize`` replaces the default rule — exactly the matching parameters are quantized
(rows = dim 0, a 1-D parameter is one row; never a scalar, an empty or an integer tensor);
``exclude`` is never quantized and wins over ``quantize``. Selecting nothing at all warns.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from lowbit_strategy import roles


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


def _default(p: nn.Parameter, owners: list[roles.Owner], output_embedding: int | None) -> tuple[bool, str]:
    if any(isinstance(o.module, roles.EMBEDDINGS) for o in owners):
        return False, "embedding (tied or not) stays full precision"
    if id(p) == output_embedding:
        return False, "output embedding (last linear shaped like the input embedding) stays full precision"
    if not any(roles.is_linear_weight(o.module, o.attr) for o in owners):
        if any(o.attr.endswith("bias") for o in owners):
            return False, "bias stays full precision"
        return False, "not a linear weight"
    if p.dim() != 2 or not p.is_floating_point() or p.numel() == 0:
        return False, "linear weight that is not a non-empty floating 2-D matrix"
    if _conv1d_weight(owners):
        return True, "linear weight (Conv1D, in x out: channels are columns)"
    return True, "linear weight"


def _conv1d_weight(owners: list[roles.Owner]) -> bool:
    return any(o.attr == "weight" and roles.is_conv1d(o.module) for o in owners)


def classify(
    model: nn.Module,
    quantize: Iterable[str] | str | None = None,
    exclude: Iterable[str] | str | None = None,
) -> dict[int, ParamInfo]:
    """Decide, for every parameter of ``model``, whether BitDP quantizes its gradient
    (frozen ones too, so unfreezing later needs no new attach). Keyed by ``id(parameter)``:
    the objects DDP's ``GradBucket.parameters()`` returns."""
    quantize_set = roles.PatternSet("quantize", roles.check_patterns("quantize", quantize))
    exclude_set = roles.PatternSet("exclude", roles.check_patterns("exclude", exclude))
    model = roles.unwrap(model)
    params = {
        id(p): p
        for _, mod in model.named_modules(remove_duplicate=False)
        for p in mod._parameters.values()
        if p is not None
    }
    head = roles.output_embedding(model)
    output_embedding = id(head.weight) if head is not None else None
    out: dict[int, ParamInfo] = {}
    for key, owners in roles.owners(model).items():
        p, names = params[key], [o.name for o in owners]
        excluded, matched = exclude_set.matches(names), quantize_set.matches(names)
        if excluded:
            q, why = False, "matches exclude"
        elif quantize_set:
            q = matched and p.is_floating_point() and p.dim() >= 1 and p.numel() > 0
            why = (
                "matches quantize"
                if q
                else ("not a non-empty floating tensor" if matched else "matches no quantize pattern")
            )
        else:
            q, why = _default(p, owners, output_embedding)
        out[key] = ParamInfo(
            tuple(names),
            tuple(type(o.module).__name__ for o in owners),
            tuple(p.shape),
            q,
            why,
            q and _conv1d_weight(owners),
        )
    example = [info.name for info in out.values()]
    exclude_set.check_all_used(example)
    quantize_set.check_all_used(example)
    if out and not any(i.quantized for i in out.values()):
        warnings.warn("BitDP selects no parameter to quantize: every gradient goes at full precision", stacklevel=3)
    return out
