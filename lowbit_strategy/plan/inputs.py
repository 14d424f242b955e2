"""The planner's inputs: a model's parameter shapes (from a count, a local Hugging Face config
or a factory), rates such as ``25gbit``, and the compute time of a step (given, or estimated
from the GPU's FLOP/s at an assumed MFU).

Every bad input raises :class:`PlanError` naming the option, the value and the fix, which the
command line prints without a traceback.
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

Shape = tuple[int, ...]

#: dense bf16 tensor-core peak, FLOP/s per GPU (vendor data sheets; SXM parts)
GPU_FLOPS = {
    "h100": 989e12,
    "h200": 989e12,
    "b200": 2250e12,
    "a100": 312e12,
    "l40s": 362e12,
    "mi300x": 1307e12,
}
#: memory per GPU, bytes (the same data sheets)
GPU_MEMORY = {"h100": 80e9, "h200": 141e9, "b200": 192e9, "a100": 80e9, "l40s": 48e9, "mi300x": 192e9}
#: per-GPU link inside a node, one direction, Gbit/s (NVLink 4: 450 GB/s; NVLink 5: 900 GB/s; L40S: PCIe 4 x16)
GPU_INTRA_GBPS = {"h100": 3600.0, "h200": 3600.0, "b200": 7200.0, "a100": 2400.0, "l40s": 256.0}
#: model FLOP utilization assumed when estimating compute (a well-tuned dense LLM run)
DEFAULT_MFU = 0.4
#: columns of the synthetic matrices a bare ``--params`` count is split into
PARAMS_WIDTH = 4096


class PlanError(ValueError):
    """A bad planner input: ``option`` got ``value``; the message says what to pass instead."""

    def __init__(self, option: str, value: object, fix: str):
        self.option, self.value = option, value
        super().__init__(f"{option}: got {value!r}; {fix}")


@dataclass(frozen=True)
class Model:
    """A model as the cost models need it: ``shapes`` of the trained parameters in
    definition order, grouped into ``units`` (index lists; one per transformer block, as
    FSDP wraps them) and described by ``source``."""

    shapes: tuple[Shape, ...]
    units: tuple[tuple[int, ...], ...]
    source: str
    #: per parameter, whether BitDP's default selection quantizes it (linear weights; not
    #: embeddings, the output head, biases or norms); None: every matrix
    quantized: tuple[bool, ...] | None = None

    def bitdp_quantized(self, i: int) -> bool:
        return len(self.shapes[i]) == 2 if self.quantized is None else self.quantized[i]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def unit_shapes(self) -> list[list[Shape]]:
        return [[self.shapes[i] for i in unit] for unit in self.units]


def _units_by_block(names: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Group parameter names by their prefix up to the first numeric component
    (``model.layers.3.``): one unit per repeated block, the rest in one root unit."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        m = re.match(r"^(.*?\.\d+)\.", name)
        groups.setdefault(m.group(1) if m else "", []).append(i)
    return tuple(tuple(v) for v in groups.values())


def from_params(count: float) -> Model:
    """A bare parameter count: matrices of :data:`PARAMS_WIDTH` columns, one unit per
    ~218 M parameters (a Llama-3-8B block), the remainder as one vector."""
    if not (isinstance(count, (int, float)) and math.isfinite(count) and count >= 1024):
        raise PlanError("--params", count, "pass a parameter count >= 1024, e.g. --params 8e9")
    n = int(count)
    rows_per_unit = max(1, 218_000_000 // PARAMS_WIDTH)
    rows, rest = divmod(n, PARAMS_WIDTH)
    shapes: list[Shape] = [(min(rows_per_unit, rows - r), PARAMS_WIDTH) for r in range(0, rows, rows_per_unit)]
    if rest:
        shapes.append((rest,))
    return Model(tuple(shapes), tuple((i,) for i in range(len(shapes))), f"{n:.3g} parameters (--params)")


def _key(cfg: dict, path: str, *names: str, default: int | None = None) -> int:
    for name in names:
        if name in cfg and cfg[name] is not None:
            value = cfg[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError("--hf-config", f"{path}: {name}={value!r}", f"{name} must be a positive integer")
            return value
    if default is not None:
        return default
    raise PlanError("--hf-config", path, f"missing {' or '.join(names)}; pass a Llama/Mistral/Qwen/GPT-2 config.json")


def from_hf_config(path: str | Path) -> Model:
    """A decoder-only transformer from a local Hugging Face ``config.json`` (no download):
    Llama-family keys (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``, ``tie_word_embeddings``;
    gated MLP, RMSNorm, no biases) or GPT-2's (``n_embd``, ``n_layer``, ``n_head``)."""
    p = str(path)
    try:
        cfg = json.loads(Path(path).read_text())
    except OSError as exc:
        raise PlanError("--hf-config", p, f"cannot read it ({exc.strerror or exc}); pass a local config.json") from None
    except json.JSONDecodeError as exc:
        raise PlanError("--hf-config", p, f"not JSON ({exc.msg} at line {exc.lineno}); pass a config.json") from None
    if not isinstance(cfg, dict):
        raise PlanError("--hf-config", p, "expected a JSON object of hyper-parameters")
    names: list[str] = []
    shapes: list[Shape] = []

    def add(name: str, *shape: int) -> None:
        names.append(name)
        shapes.append(tuple(shape))

    if "n_embd" in cfg:  # GPT-2: fused qkv, biases, LayerNorms, tied head, learned positions
        d, layers, vocab = _key(cfg, p, "n_embd"), _key(cfg, p, "n_layer"), _key(cfg, p, "vocab_size")
        ff = _key(cfg, p, "n_inner", default=4 * d)
        add("wte", vocab, d)
        add("wpe", _key(cfg, p, "n_positions", default=1024), d)
        for i in range(layers):
            for name, shape in (("ln_1.w", (d,)), ("ln_1.b", (d,)), ("attn.c_attn.w", (d, 3 * d))):
                add(f"h.{i}.{name}", *shape)
            for name, shape in (("attn.c_attn.b", (3 * d,)), ("attn.c_proj.w", (d, d)), ("attn.c_proj.b", (d,))):
                add(f"h.{i}.{name}", *shape)
            for name, shape in (("ln_2.w", (d,)), ("ln_2.b", (d,)), ("mlp.c_fc.w", (d, ff)), ("mlp.c_fc.b", (ff,))):
                add(f"h.{i}.{name}", *shape)
            add(f"h.{i}.mlp.c_proj.w", ff, d)
            add(f"h.{i}.mlp.c_proj.b", d)
        add("ln_f.w", d)
        add("ln_f.b", d)
    else:
        d, layers = _key(cfg, p, "hidden_size"), _key(cfg, p, "num_hidden_layers")
        heads = _key(cfg, p, "num_attention_heads")
        kv = _key(cfg, p, "num_key_value_heads", default=heads)
        head_dim = _key(cfg, p, "head_dim", default=d // heads)
        ff, vocab = _key(cfg, p, "intermediate_size"), _key(cfg, p, "vocab_size")
        add("model.embed_tokens", vocab, d)
        for i in range(layers):
            pre = f"model.layers.{i}."
            add(pre + "input_layernorm", d)
            add(pre + "self_attn.q_proj", heads * head_dim, d)
            add(pre + "self_attn.k_proj", kv * head_dim, d)
            add(pre + "self_attn.v_proj", kv * head_dim, d)
            add(pre + "self_attn.o_proj", d, heads * head_dim)
            add(pre + "post_attention_layernorm", d)
            add(pre + "mlp.gate_proj", ff, d)
            add(pre + "mlp.up_proj", ff, d)
            add(pre + "mlp.down_proj", d, ff)
        add("model.norm", d)
        if not cfg.get("tie_word_embeddings", False):
            add("lm_head", vocab, d)
    embeddings = ("embed_tokens", "lm_head", "wte", "wpe")  # BitDP keeps them in full precision
    quantized = tuple(len(s) == 2 and not any(e in n for e in embeddings) for n, s in zip(names, shapes))
    source = f"{Path(path).name} ({sum(map(math.prod, shapes)):,} params)"
    return Model(tuple(shapes), _units_by_block(names), source, quantized)


def from_factory(spec: str) -> Model:
    """``pkg.mod:factory``: ``factory()`` called under the meta device (no memory) and its
    trained parameters read."""
    import torch

    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise PlanError("--model", spec, "pass an importable 'package.module:factory' returning an nn.Module")
    try:
        factory = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as exc:
        raise PlanError("--model", spec, f"cannot import it ({exc}); check PYTHONPATH and the name") from None
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, torch.nn.Module):
        raise PlanError("--model", spec, f"the factory returned a {type(model).__name__}; it must return an nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise PlanError("--model", spec, "the model has no trained parameters")
    return from_module(model, spec)


def from_module(model, label: str) -> Model:
    """The trained parameters of ``model`` (any device, meta included), with BitDP's own
    default selection (:func:`~lowbit_strategy.algorithms.bitdp.quantized_params.classify`)."""
    from lowbit_strategy.algorithms.bitdp.quantized_params import classify

    chosen = classify(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return Model(
        tuple(tuple(p.shape) for _, p in named),
        _units_by_block([n for n, _ in named]),
        f"{label} ({sum(p.numel() for _, p in named):,} params)",
        tuple(chosen[id(p)].quantized for _, p in named),
    )


_RATE = re.compile(r"^\s*([0-9.]+(?:e[+-]?\d+)?)\s*([kmgt]?)(bit|bps|b/s|gbit/s)?\s*$", re.IGNORECASE)


def parse_rate(option: str, text: str | float) -> float:
    """A link rate in Gbit/s from ``25gbit``, ``100mbit``, ``3.2tbit``, ``400Gbps`` or a bare
    number (Gbit/s)."""
    if isinstance(text, (int, float)):
        value, unit = float(text), "g"
    else:
        m = _RATE.match(str(text))
        if not m:
            raise PlanError(option, text, "pass a rate such as 25gbit, 100mbit, 3.2tbit or a number of Gbit/s")
        value, unit = float(m.group(1)), (m.group(2) or "g").lower()
    gbps = value * {"k": 1e-6, "m": 1e-3, "g": 1.0, "t": 1e3}[unit]
    if not (gbps > 0 and math.isfinite(gbps)):
        raise PlanError(option, text, "the rate must be a positive, finite number")
    return gbps


@dataclass(frozen=True)
class Compute:
    """Seconds of forward + backward per step on one GPU, and how the figure was obtained."""

    seconds: float
    note: str


def compute_time(
    model: Model,
    world_size: int,
    seconds: float | None = None,
    gpu: str | None = None,
    tokens_per_step: float | None = None,
    mfu: float = DEFAULT_MFU,
) -> Compute:
    """Given ``seconds``, or ``6·N·tokens / (P · peak · mfu)`` for ``tokens_per_step``
    tokens per optimizer step over all P GPUs."""
    if seconds is not None:
        if not (seconds > 0 and math.isfinite(seconds)):
            raise PlanError("--compute-s", seconds, "pass the seconds of forward + backward per step, > 0")
        return Compute(seconds, f"compute {seconds:.3g} s per step (given)")
    if gpu is None or tokens_per_step is None:
        raise PlanError(
            "--compute-s", None, "pass --compute-s SECONDS, or --gpu NAME with --tokens-per-step TOKENS to estimate it"
        )
    peak = GPU_FLOPS.get(gpu.lower())
    if peak is None:
        raise PlanError("--gpu", gpu, f"use one of {', '.join(GPU_FLOPS)} (or give --compute-s)")
    if not (tokens_per_step > 0 and 0 < mfu <= 1):
        raise PlanError("--tokens-per-step/--mfu", (tokens_per_step, mfu), "tokens > 0 and 0 < MFU <= 1")
    flops = 6 * model.numel * tokens_per_step
    s = flops / (world_size * peak * mfu)
    note = (
        f"compute {s:.3g} s per step estimated: 6 x {model.numel:.3g} params x {tokens_per_step:.3g} tokens "
        f"/ ({world_size} x {gpu} at {peak / 1e12:.0f} TFLOP/s bf16 x {mfu:.0%} MFU)"
    )
    return Compute(s, note)
