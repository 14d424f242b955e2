"""Reading a LowBitConfig's YAML file: strictly, so that a bad file fails where it is read with
the file, line and column named (:class:`~lowbit_strategy.validation.ConfigError`), never
silently (a key given twice, anchors that expand to gigabytes, a file far too long). What the
values mean is :class:`~lowbit_strategy.config.LowBitConfig`'s business."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lowbit_strategy.validation import ConfigError

__all__ = ["MAX_YAML_BYTES", "merge", "read_mapping"]


def read_mapping(path: str | os.PathLike) -> Mapping[str, Any]:
    """The mapping of field names to values in the YAML file at ``path``, at its top level or
    under a ``lowbit:`` key (an empty file: no fields)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError("<file>", str(path), f"cannot read the YAML file: {exc.strerror or exc}") from None
    if len(text) > MAX_YAML_BYTES:
        raise ConfigError(
            "<file>",
            str(path),
            f"a config file of {len(text)} bytes is too long (at most {MAX_YAML_BYTES}): is it the right file?",
        )
    try:
        data = yaml.load(text, Loader=_strict_loader())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError("<file>", str(path), f"not valid YAML{where}: {problem}") from None
    data = {} if data is None else data
    if isinstance(data, Mapping) and set(data) == {"lowbit"}:
        data = data["lowbit"] or {}
    if not isinstance(data, Mapping):
        raise ConfigError(
            "<file>", str(path), f"expected a mapping of field names to values, got a {type(data).__name__}"
        )
    return data


#: the longest config file read (a config is a few hundred bytes)
MAX_YAML_BYTES = 1 << 20


def _strict_loader():
    """PyYAML's safe loader, refusing what a config file never needs and what silently goes
    wrong: a key given twice (the last would win), and anchors/aliases (a few hundred bytes
    of nested aliases expand to gigabytes)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise yaml.composer.ComposerError(
                    None, None, "anchors and aliases (*name) are not supported in a lowbit config", event.start_mark
                )
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"the key {key!r} is given twice (the first at line {seen[key] + 1})",
                        key_node.start_mark,
                    )
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """``top`` over ``base``, nested mappings (sections) merged key by key."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) else value
    return out
