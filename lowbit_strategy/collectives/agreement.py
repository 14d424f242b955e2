"""Agreements across ranks: before an optimizer-level step (which parameters have a gradient
on any rank, and whether any rank saw NaN/Inf), and at setup (whether every rank runs the
same configuration: :func:`check_same`).

With local gradients both can differ across ranks; acting on a local view would make ranks
enter different collectives (a hang) or diverge. One small int32 SUM allreduce answers both.
A configuration that differs across ranks (a ``LOWBIT_*`` variable exported in one process,
``debug`` on one rank) would make ranks run different collectives: a hang until the process
group's timeout, or one rank aborting. :func:`check_same` turns it into one clear error on
every rank, before any other collective.
"""

from __future__ import annotations

import hashlib
import reprlib
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from lowbit_strategy.collectives import group as g


def agree(
    has_grad: Sequence[bool], nonfinite, group, op: str, traffic=None, device: torch.device | str = "cpu"
) -> tuple[list[bool], bool]:
    """``([any rank has a gradient for parameter i], any rank non-finite)``.

    ``nonfinite``: this rank's flag (a bool, a 0-d tensor on the device, or None for
    False). ``device`` must be one the backend can reduce on (NCCL needs CUDA)."""
    flags = torch.tensor(list(has_grad) + [0], dtype=torch.int32, device=device)
    if nonfinite is not None:
        flags[-1] = torch.as_tensor(nonfinite, device=device).to(torch.int32)
    g.all_reduce_sum(flags, group, op, traffic)
    counts = flags.tolist()
    return [f > 0 for f in counts[:-1]], counts[-1] > 0


_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlist, _SHORT.maxdict = 40, 40, 6, 6


def check_same(
    fields: Mapping[str, object], group, what: str, error: Callable[[str, list[str]], Exception] | None = None
) -> None:
    """Raise the same exception on every rank of ``group`` unless every rank passed equal
    ``fields`` (a flat mapping of names to values), naming each field that differs and the
    ranks holding each value: ``error(message, differing field names)``, a ``ValueError`` by
    default. One small all-gather of field digests (and short reprs) over a CPU group;
    nothing with one process."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = {str(k): (hashlib.sha256(repr(v).encode()).hexdigest()[:16], _SHORT.repr(v)) for k, v in fields.items()}
    every: list[dict[str, tuple[str, str]]] = [{} for _ in range(dist.get_world_size(group))]
    dist.all_gather_object(every, mine, group=g.cpu_group(group))
    names = sorted(set().union(*every))
    differing, differing_names = [], []
    for name in names:
        values: dict[str, list[int]] = {}
        for r, theirs in enumerate(every):
            digest, short = theirs.get(name, ("-", "<missing>"))
            values.setdefault(digest + short, []).append(r)
        if len(values) > 1:
            shown = "; ".join(f"{key[16:]} on rank(s) {ranks}" for key, ranks in values.items())
            differing.append(f"{name}: {shown}")
            differing_names.append(name)
    if differing:
        message = (
            f"{what} differs across ranks, and every rank must run the same: "
            + " | ".join(differing[:8])
            + (f" | and {len(differing) - 8} more" if len(differing) > 8 else "")
            + ". Check each process's LOWBIT_* environment, config file and arguments"
        )
        raise (error or (lambda m, _: ValueError(m)))(message, differing_names)
