"""Signs with a deterministic tie rule (Lion Cub App. B.1).

A 1-bit code cannot say "zero". Lion Cub found that sending exact zeros always as +1 (or
always as -1) accumulates a bias that makes training diverge (Fig. 10), and that
alternating the choice between steps fixes it at no cost:

    tie (exact zero) -> +1 on odd steps, -1 on even steps.

``step`` is the optimizer's step count, starting at 1 for the first step (as
``torch.optim`` counts it), so the very first step breaks ties upwards. The same rule is
used for the local signs a rank sends and for the tied votes of a majority.
"""
from __future__ import annotations

import torch


def tie_is_positive(step: int) -> bool:
    """Whether a tie at ``step`` resolves to +1 (odd steps) or -1 (even steps)."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int (the optimizer step, from 1), got {step!r}")
    return step % 2 == 1


def _check_no_nan(x: torch.Tensor, what: str) -> None:
    if x.dtype.is_floating_point and bool(torch.isnan(x).any()):
        raise ValueError(f"{what}: input contains NaN; its sign is undefined")


def sign_bits(x: torch.Tensor, step: int) -> torch.Tensor:
    """1-bit sign codes of ``x``: uint8 1 for positive, 0 for negative.

    Exact zeros follow the alternating rule of :func:`tie_is_positive`. ``+inf`` and
    ``-inf`` are ordinary signs; NaN raises ``ValueError``.
    """
    _check_no_nan(x, "sign_bits")
    positive = x > 0
    if tie_is_positive(step):
        positive |= x == 0
    return positive.to(torch.uint8)


def sign_alternating(x: torch.Tensor, step: int) -> torch.Tensor:
    """±1 of ``x`` as int8, exact zeros by the alternating rule (never 0)."""
    return sign_bits(x, step).to(torch.int8) * 2 - 1
