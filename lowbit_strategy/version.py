"""The installed distribution's version, read from the package metadata (``pyproject.toml``)."""

from __future__ import annotations


def installed_version() -> str:
    """``lowbit-strategy``'s version as pip installed it; ``0+unknown`` for a source tree on
    ``sys.path`` that pip never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lowbit-strategy")
    except PackageNotFoundError:
        return "0+unknown"
