"""Streaming DiLoCo's fragments: which parameters sync together, and when.

"Streaming DiLoCo with overlapping communication" (arXiv:2501.18512, Sec. 2.2) splits the
model into fragments of transformer blocks taken with a stride through depth (fragment f
holds blocks f, f + F, f + 2F, ...), so every fragment spans the whole depth and each sync
moves 1/F of the model.

**Blocks** here: a parameter's block is its name up to and including the first numeric
component (``transformer.h.3.attn.c_attn.weight`` → ``transformer.h.3``; the entries of an
``nn.ModuleList`` / ``nn.Sequential``); a parameter with no numeric component (embeddings,
the final norm, the head) is a block of its own. Blocks are numbered in the order their
first parameter appears in ``named_parameters()`` (the same on every rank: the setup
handshake compares the parameter names), and block i goes to fragment ``i % F``: a
deterministic tie-free rule every rank computes alike.

**Schedule**: fragment f syncs after the optimizer steps t (counted from 1) with
``(t + f·H // F) % H == 0``: fragment 0 after steps H, 2H, ...; the others evenly
staggered in between, each once per H steps.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["block_of", "fragment_of", "syncs_after", "offset"]


def block_of(name: str) -> str:
    """The block a parameter named ``name`` belongs to (module docstring)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return name


def blocks(names: Sequence[str]) -> list[str]:
    """The blocks of ``names``, in order of first appearance."""
    return list(dict.fromkeys(block_of(n) for n in names))


def fragment_of(names: Sequence[str], fragments: int) -> list[int]:
    """For each name, its fragment: its block's index modulo ``fragments``."""
    index = {b: i for i, b in enumerate(blocks(names))}
    return [index[block_of(n)] % fragments for n in names]


def offset(fragment: int, fragments: int, sync_every: int) -> int:
    """How many steps before the round's end fragment ``fragment`` syncs: ``f·H // F``."""
    return fragment * sync_every // fragments


def syncs_after(step: int, fragment: int, fragments: int, sync_every: int) -> bool:
    """Whether ``fragment`` syncs after optimizer step ``step`` (counted from 1)."""
    return (step + offset(fragment, fragments, sync_every)) % sync_every == 0
