"""LowBitConfig: the shared fields, plus one section per algorithm.

::

    LowBitConfig(algorithm="lion", lion={"mode": "lp", "bits": 8})
    LowBitConfig(algorithm="lion", mode="lp", bits=8)        # the same: shorthand for the active section
    LowBitConfig(algorithm="bitdp", bitdp_bits=1)            # <section>_<field> reaches any section
    LowBitConfig.from_yaml("lowbit.yaml")                    # algorithm: bitdp / bitdp: {bits: 1} (config_yaml)
    LowBitConfig.from_env()        # LOWBIT_CONFIG=path, LOWBIT_ALGORITHM, LOWBIT_BITDP_BITS, LOWBIT_BITS

The shared fields (:data:`SHARED_FIELDS`) apply to every algorithm. Each algorithm in the
registry (:mod:`lowbit_strategy.algorithms`) contributes a :class:`Section`, a frozen
dataclass that validates its own fields where it is defined; ``config.lion`` /
``config.bitdp`` read them, ``config.section`` is the active algorithm's. Strings (from YAML
or the environment) are converted to each field's type. Every invalid value raises
:class:`ConfigError` naming the field (``LowBitConfig.lion.mode``), the value and what is
allowed; an unreadable or malformed YAML file names the file and the line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from lowbit_strategy import config_yaml
from lowbit_strategy.algorithms import REGISTRY, Algorithm
from lowbit_strategy.collectives import emulation
from lowbit_strategy.collectives.exact import WARMUP_WIRES, exact_wire
from lowbit_strategy.pricing import link_probe
from lowbit_strategy.section import SHARED_FIELDS, Section
from lowbit_strategy.validation import (
    ConfigError,
    as_bool,
    as_choice,
    as_float,
    as_float_or_measure,
    as_int,
    is_none,
    suggestion,
)

__all__ = ["ConfigError", "LowBitConfig", "Section", "SHARED_FIELDS"]


#: the largest bucket (64 GiB of float32): beyond it the bucket's element count overflows
#: what a collective can move in one call
MAX_BUCKET_MB = 65536.0
#: the values of LowBitConfig.topology
TOPOLOGIES = ("auto", "flat", "hierarchical")
#: the values of LowBitConfig.fsdp_shard
FSDP_SHARDS = ("node", "world")
#: the values of LowBitConfig.fsdp_reduce_scatter (fp32: FSDP's own reduce-scatter)
FSDP_REDUCE_SCATTERS = ("fp32", "int8", "int4", "int2")


class LowBitConfig:
    """Every knob of the low-bit algorithms, validated once, immutable afterwards.

    Shared fields:
        algorithm: which algorithm drives synchronization (a name of
            :data:`lowbit_strategy.algorithms.REGISTRY`: ``lion``, ``bitdp``).
        bucket_size_mb: size of the flat buckets synchronized with one collective each.
        warmup_steps: steps run uncompressed before compression starts.
        warmup_wire: what every full-precision phase sends across nodes: the warm-ups
            (1-bit Adam/LAMB's ``freeze_step``, TurboQuant-Adam's ``warmup_steps``, Lion Cub's
            and BitDP's ``warmup_steps``) and the uncompressed form an ``auto`` plan falls
            back to. ``bf16`` (default): the mean as torch's ``bf16_compress_hook`` computes
            it (each gradient cast to bf16, divided by the workers, summed in bf16), half of
            DDP fp32's bytes and never more than DDP with bf16 communication sends; inside a
            node the reduction stays exact. ``fp32``: DDP's own exact mean, as the papers'
            warm-ups run. ``int2`` (1-bit Adam/LAMB and TurboQuant-Adam only): their warm-ups
            send BitDP's 2-bit channel codes with error feedback across nodes (an eighth of
            bf16's bytes for the linear weights; the first two steps, and every gradient
            BitDP does not code, in bf16: :mod:`~lowbit_strategy.algorithms.staged.warmup_codes`),
            their fallbacks bf16: faster to a target on slow links, but measured to cost 1-bit
            Adam 2.7 % of final loss (its frozen variance comes from 2-bit codes), so not the
            default. :attr:`exact_wire` is what uncompressed exchanges send.
        link_bandwidth_gbps, link_latency_us: the network the ``auto`` plans are made for
            (Gbit/s and µs per message), or ``"measure"`` (the default): at attach, every rank
            probes the link for well under 2 s and the slowest figure is used
            (:mod:`lowbit_strategy.pricing.link_probe`; only when an ``auto`` reads it).
            :attr:`link` reads them, with 1 Gbit/s and 50 µs where nothing was measured.
        debug: run extra checks (one more small collective per call verifying that every
            rank passes the same lengths).
        compile_codecs: run some codecs' elementwise chains compiled with ``torch.compile``
            (CPU and CUDA), bit for bit the eager codecs' results; opt-in because each process pays
            for compiling on first use (seconds; :mod:`lowbit_strategy.codecs.compiled`). It pays
            on CPU ranks; on an H100 no chain was faster than eager, so leave it off on CUDA.
            Without a working compiler the eager codecs run, after one warning; so they do where a
            chain's first call differs from the same chain run eagerly (a stale cached kernel).
        topology: ``flat`` (the P ranks as one group), ``hierarchical`` (an exact reduction
            inside each node, the algorithm's compressed collective between nodes on a
            1/L shard per local rank, an all-gather inside the node: only what crosses nodes
            is compressed) or ``auto`` (hierarchical when there are >= 2 nodes of >= 2 ranks;
            :mod:`lowbit_strategy.collectives.hierarchy`).
        ranks_per_node: L, the ranks of one node (contiguous rank blocks of equal size);
            None reads it from the launcher (torchrun's / Accelerate's ``LOCAL_WORLD_SIZE``,
            Lightning's devices per node).
        fsdp_shard: where the sharded front ends (:func:`~lowbit_strategy.attach_sharded`,
            the ``*_fsdp`` Lightning strategies, Accelerate and the HF ``Trainer`` with FSDP2)
            shard the model: ``node`` (FSDP2 inside each node, the algorithm's low-bit
            exchange across nodes) or ``world`` (one FSDP group over every rank, for a model
            that does not fit in one node: the gradient is reduced by FSDP's reduce-scatter
            alone, which ``fsdp_reduce_scatter`` can quantize; the algorithm's exchange then
            has one worker and its optimizer runs as the plain one would).
        fsdp_reduce_scatter: FSDP2's gradient reduce-scatter: ``fp32`` (FSDP's own, in its
            reduce dtype) or ``int8`` / ``int4`` / ``int2``, blockwise-quantized all-to-alls
            (two hops when the FSDP group spans nodes: exact inside the node, quantized
            across; :mod:`lowbit_strategy.collectives.fsdp_reduce_scatter`).

    Sections: one per registered algorithm, each a :class:`Section` (``config.lion``,
    ``config.bitdp``); see each algorithm's ``config`` module for its fields. Keyword
    arguments may name a section (a mapping or a section object), a field of the active
    algorithm's section (``mode="lp"`` with ``algorithm="lion"``), or any section's field
    as ``<section>_<field>`` (``bitdp_bits=1``).
    """

    __slots__ = (
        "algorithm",
        "bucket_size_mb",
        "warmup_steps",
        "warmup_wire",
        "link_bandwidth_gbps",
        "link_latency_us",
        "debug",
        "compile_codecs",
        "topology",
        "ranks_per_node",
        "fsdp_shard",
        "fsdp_reduce_scatter",
        "fsdp_error_feedback",
        "_sections",
    )

    # the slots' types (annotations only: set once, through object.__setattr__, in __init__)
    algorithm: str
    bucket_size_mb: float
    warmup_steps: int
    warmup_wire: str
    link_bandwidth_gbps: float | str
    link_latency_us: float | str
    debug: bool
    compile_codecs: bool
    topology: str
    ranks_per_node: int | None
    fsdp_shard: str
    fsdp_reduce_scatter: str
    fsdp_error_feedback: bool
    _sections: dict[str, Section]

    def __init__(
        self,
        algorithm: str = "lion",
        bucket_size_mb: float = 25.0,
        warmup_steps: int = 0,
        warmup_wire: str = "bf16",
        link_bandwidth_gbps: float | str = "measure",
        link_latency_us: float | str = "measure",
        debug: bool = False,
        compile_codecs: bool = False,
        topology: str = "auto",
        ranks_per_node: int | None = None,
        fsdp_shard: str = "node",
        fsdp_reduce_scatter: str = "fp32",
        fsdp_error_feedback: bool = False,
        **sections: Any,
    ) -> None:
        registry = REGISTRY
        set_ = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 (immutable)
        set_("algorithm", as_choice("algorithm", algorithm, tuple(registry)))
        set_("bucket_size_mb", as_float("bucket_size_mb", bucket_size_mb, positive=True, maximum=MAX_BUCKET_MB))
        set_("warmup_steps", as_int("warmup_steps", warmup_steps, 0, 2**62))
        set_("warmup_wire", as_choice("warmup_wire", warmup_wire, WARMUP_WIRES))
        set_("link_bandwidth_gbps", as_float_or_measure("link_bandwidth_gbps", link_bandwidth_gbps, positive=True))
        set_("link_latency_us", as_float_or_measure("link_latency_us", link_latency_us, positive=False))
        set_("debug", as_bool("debug", debug))
        set_("compile_codecs", as_bool("compile_codecs", compile_codecs))
        set_("topology", as_choice("topology", topology, TOPOLOGIES))
        set_("ranks_per_node", None if is_none(ranks_per_node) else as_int("ranks_per_node", ranks_per_node, 1, 2**20))
        set_("fsdp_shard", as_choice("fsdp_shard", fsdp_shard, FSDP_SHARDS))
        set_("fsdp_reduce_scatter", as_choice("fsdp_reduce_scatter", fsdp_reduce_scatter, FSDP_REDUCE_SCATTERS))
        set_("fsdp_error_feedback", as_bool("fsdp_error_feedback", fsdp_error_feedback))
        if self.warmup_wire == "int2" and not registry[self.algorithm].coded_warmup:
            coded = ", ".join(n for n, a in registry.items() if a.coded_warmup)
            raise ConfigError(
                "warmup_wire",
                warmup_wire,
                f"int2 codes the warm-ups of {coded}; algorithm {self.algorithm!r} has none to code: "
                "use 'bf16' (the default) or 'fp32'",
            )
        values = self._route(sections, registry)
        set_("_sections", {name: algo.section.from_dict(values[name]) for name, algo in registry.items()})

    def _route(self, given: Mapping[str, Any], registry: Mapping[str, Algorithm]) -> dict[str, dict[str, Any]]:
        """Sort keyword arguments into sections: whole sections first, then ``<section>_<field>``,
        then shorthands for the active section (later forms override earlier ones)."""
        out: dict[str, dict[str, Any]] = {name: {} for name in registry}
        active = registry[self.algorithm].section
        for key, value in given.items():
            if key in registry:
                if isinstance(value, Section):
                    value = value.to_dict()
                if not isinstance(value, Mapping):
                    raise ConfigError(
                        key, value, f"expected a mapping of {key} fields: {', '.join(registry[key].section.fields())}"
                    )
                out[key].update(value)
        for key, value in given.items():
            if key in registry:
                continue
            section = next(
                (n for n in registry if key.startswith(n + "_") and key[len(n) + 1 :] in registry[n].section.fields()),
                None,
            )
            if section is not None:
                out[section][key[len(section) + 1 :]] = value
            elif key in active.fields():
                out[self.algorithm][key] = value
            else:
                known = self.known_keys(self.algorithm)
                raise ConfigError(
                    key,
                    value,
                    f"unknown field{suggestion(key, known)}; shared fields: "
                    f"{', '.join(SHARED_FIELDS)}; {self.algorithm} fields: "
                    f"{', '.join(active.fields())}; other sections: "
                    f"{', '.join(n for n in registry if n != self.algorithm)}",
                )
        return out

    # ---- reading ------------------------------------------------------------------
    @property
    def section(self) -> Section:
        """The active algorithm's section."""
        return self._sections[self.algorithm]

    @property
    def exact_wire(self) -> str:
        """What an uncompressed exchange sends (a fallback, Lion Cub's and BitDP's first steps):
        :attr:`warmup_wire`, or ``bf16`` where that is ``int2``."""
        return exact_wire(self.warmup_wire)

    @property
    def link(self) -> tuple[float, float]:
        """``(latency in s, bandwidth in bit/s)`` for the cost models: the fields' figures,
        or for one still ``"measure"`` (one rank, or a config no attach resolved) the
        :mod:`~lowbit_strategy.pricing.link_probe` fallbacks, 50 µs and 1 Gbit/s."""
        gbps, us = self.link_bandwidth_gbps, self.link_latency_us
        return (50.0 if isinstance(us, str) else us) * 1e-6, (1.0 if isinstance(gbps, str) else gbps) * 1e9

    def __getattr__(self, name: str) -> Section:
        sections = object.__getattribute__(self, "_sections")
        if name in sections:
            return sections[name]
        raise AttributeError(f"LowBitConfig has no field or section {name!r}; sections: {', '.join(sections)}")

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"LowBitConfig is immutable; use config.replace({name}=...)")

    def to_dict(self) -> dict[str, Any]:
        """Shared fields and every section, as plain values (round-trips through :meth:`from_dict`)."""
        out = {name: getattr(self, name) for name in SHARED_FIELDS}
        out.update({name: section.to_dict() for name, section in self._sections.items()})
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LowBitConfig) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(repr(self))

    def __repr__(self) -> str:
        shared = ", ".join(f"{k}={getattr(self, k)!r}" for k in SHARED_FIELDS)
        return f"LowBitConfig({shared}, {self.algorithm}={self.section!r})"

    def __reduce__(self):
        return (_from_dict, (self.to_dict(),))

    @classmethod
    def known_keys(cls, algorithm: str | None = None) -> tuple[str, ...]:
        """Every keyword :class:`LowBitConfig` accepts (shorthands for ``algorithm``'s section
        when given, else for every section)."""
        registry = REGISTRY
        keys = list(SHARED_FIELDS) + list(registry)
        for name, algo in registry.items():
            keys += [f"{name}_{f}" for f in algo.section.fields()]
            if algorithm in (None, name):
                keys += list(algo.section.fields())
        return tuple(dict.fromkeys(keys))

    # ---- building -----------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> LowBitConfig:
        """From a mapping of shared fields, sections and shorthands (see the class doc)."""
        if not isinstance(values, Mapping):
            raise ConfigError("<root>", values, "expected a mapping of field names to values")
        return cls(**{str(k): v for k, v in values.items()})

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> LowBitConfig:
        """From a YAML mapping, either at the top level or under a ``lowbit:`` key
        (read strictly: :func:`~lowbit_strategy.config_yaml.read_mapping`)."""
        return cls.from_dict(config_yaml.read_mapping(path))

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, prefix: str = "LOWBIT_", **defaults: Any
    ) -> LowBitConfig:
        """From the environment, over ``defaults``: ``LOWBIT_CONFIG`` names a YAML file read
        first; then ``LOWBIT_<FIELD>`` for a shared field or a field of the active section
        (``LOWBIT_MODE=lp``) and ``LOWBIT_<SECTION>_<FIELD>`` for any section
        (``LOWBIT_BITDP_BITS=1``). An unknown ``LOWBIT_`` variable is an error (``LOWBIT_EMULATE_NCCL``
        is not a field: it switches on :mod:`~lowbit_strategy.collectives.emulation`)."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = dict(defaults)
        path = env.get(prefix + "CONFIG")
        if path:
            values = config_yaml.merge(values, cls.from_yaml(path).to_dict())
        known = {k.upper(): k for k in cls.known_keys()}
        for var in sorted(env):
            if not var.startswith(prefix) or var in (prefix + "CONFIG", emulation.ENV, link_probe.ASSUME_ENV):
                continue
            key = var[len(prefix) :]
            if key not in known:
                raise ConfigError(
                    key.lower(),
                    env[var],
                    f"unknown variable {var}{suggestion(key, known)}; use {prefix}<FIELD> or {prefix}<SECTION>_<FIELD>",
                )
            values[known[key]] = env[var]
        return cls.from_dict(values)

    @classmethod
    def coerce(
        cls, source: LowBitConfig | Mapping[str, Any] | str | os.PathLike | None = None, **overrides: Any
    ) -> LowBitConfig:
        """Any accepted form (config, dict, YAML path or None) with keyword overrides on top."""
        if source is None:
            base: dict[str, Any] = {}
        elif isinstance(source, LowBitConfig):
            base = source.to_dict()
        elif isinstance(source, Mapping):
            base = dict(source)
        elif isinstance(source, (str, os.PathLike)):
            base = cls.from_yaml(source).to_dict()
        else:
            raise ConfigError("<root>", source, "expected a LowBitConfig, a dict, a YAML file path or None")
        return cls.from_dict({**base, **overrides})

    def replace(self, **changes: Any) -> LowBitConfig:
        return self.coerce(self, **changes)


def _from_dict(values: Mapping[str, Any]) -> LowBitConfig:
    return LowBitConfig.from_dict(values)
