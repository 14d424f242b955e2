"""The config section every algorithm defines, and the fields all algorithms share.

Both sides import this module: each algorithm's ``config.py`` subclasses :class:`Section`,
the registry (:mod:`lowbit_strategy.algorithms`) checks sections against
:data:`SHARED_FIELDS`, and :class:`~lowbit_strategy.config.LowBitConfig` (which reads the
registry) holds the shared fields and one section per algorithm. So imports point one way:
``config`` → ``algorithms`` → ``section`` → ``validation``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from lowbit_strategy.validation import ConfigError, suggestion

__all__ = ["SHARED_FIELDS", "Section"]

#: Fields every algorithm shares, with their defaults.
SHARED_FIELDS: dict[str, Any] = {
    "algorithm": "lion",
    "bucket_size_mb": 25.0,
    "warmup_steps": 0,
    "warmup_wire": "bf16",
    "link_bandwidth_gbps": "measure",
    "link_latency_us": "measure",
    "debug": False,
    "compile_codecs": False,
    "topology": "auto",
    "ranks_per_node": None,
    "fsdp_shard": "node",
    "fsdp_reduce_scatter": "fp32",
    "fsdp_error_feedback": False,
}


@dataclasses.dataclass(frozen=True)
class Section:
    """Base of an algorithm's config section (a frozen dataclass).

    Subclasses set :attr:`name` (the algorithm's name, also the key of the section in
    YAML, keyword arguments and ``LOWBIT_<NAME>_<FIELD>``) and validate in
    ``__post_init__`` with :meth:`_set` and the converters of :mod:`lowbit_strategy.validation`,
    naming fields through :meth:`field_name` so errors read ``LowBitConfig.<name>.<field>``.
    """

    name: ClassVar[str] = ""

    @classmethod
    def field_name(cls, field: str) -> str:
        return f"{cls.name}.{field}"

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Section:
        if isinstance(values, cls):
            return values
        if not isinstance(values, Mapping):
            raise ConfigError(cls.name, values, f"expected a mapping of {cls.name} fields: {', '.join(cls.fields())}")
        for key in values:
            if key not in cls.fields():
                raise ConfigError(
                    cls.field_name(str(key)),
                    values[key],
                    f"unknown field{suggestion(key, cls.fields())}; fields are: {', '.join(cls.fields())}",
                )
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _set(self, field: str, value: Any) -> None:
        object.__setattr__(self, field, value)  # frozen: only __post_init__ writes
