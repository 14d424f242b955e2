"""Agreement before an optimizer-level step: which parameters have a gradient on any rank,
and whether any rank saw NaN/Inf.

With local gradients both can differ across ranks; acting on a local view would make ranks
enter different collectives (a hang) or diverge. One small int32 SUM allreduce answers both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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
