"""p-bit direct allreduce of packed lanes (Lion Cub Sec. 3 and App. F.1).

Every rank holds integer codes in a declared range; the result is their exact sum over
ranks. Codes are shifted to be non-negative, packed into lanes wide enough that the sum
over P ranks cannot carry into the neighbouring lane, and summed with *one* ordinary
integer SUM allreduce: the packed words add lane by lane.

* signed codes in [-L, L] are shifted by +L, so a lane must hold 2·L·P;
* unsigned codes in [0, L] (e.g. Lion Cub's 0/1 votes, "{-1, 1} -> {0, 1}") need L·P.

The lane is the narrowest of :data:`lowbit_strategy.codecs.bits.LANE_BITS` that holds the
sum, unless ``lane_bits`` fixes it; a range that no lane can hold raises
``OverflowError`` naming the limit and what to change. (The reference implementation of
the paper silently wraps around past 15 workers at 4 bits; this one never does.)

Bandwidth per rank: 2(P-1)/P · N · lane_bits bits.
"""

from __future__ import annotations

import torch

from lowbit_strategy.codecs import bits as lanes
from lowbit_strategy.collectives import group as g
from lowbit_strategy.validation import check_int


def lane_for(world_size: int, levels: int, *, signed: bool = True, lane_bits: int | None = None) -> lanes.Lane:
    """The lane that holds the sum over ``world_size`` ranks of codes with ``levels``.

    Raises ``OverflowError`` if the fixed ``lane_bits`` (or every supported lane) is too
    narrow, with the largest ``levels`` that would fit.
    """
    check_int("lane_for", "levels", levels, 1, what=" (codes lie in [-levels, levels])")
    span = 2 * levels if signed else levels
    need = span * world_size
    rng = f"[-{levels}, {levels}]" if signed else f"[0, {levels}]"
    if lane_bits is None:
        try:
            return lanes.narrowest_lane(need)
        except OverflowError:
            raise OverflowError(
                f"the sum over {world_size} ranks of codes in {rng} reaches {need}, more than any "
                f"supported lane holds ({lanes.lane(32).capacity}); lower levels to at most "
                f"{max_levels(world_size, 32, signed=signed)}"
            ) from None
    spec = lanes.lane(lane_bits)
    if spec.capacity < need:
        fit = max_levels(world_size, lane_bits, signed=signed)
        fix = f"lower levels to at most {fit}" if fit >= 1 else "no level count fits this lane at this world size"
        raise OverflowError(
            f"the sum over {world_size} ranks of codes in {rng} reaches {need}, but a "
            f"{lane_bits}-bit lane holds at most {spec.capacity}; {fix}, or use a wider lane"
        )
    return spec


def max_levels(world_size: int, lane_bits: int, *, signed: bool = True) -> int:
    """The largest ``levels`` whose sum over ``world_size`` ranks fits a ``lane_bits`` lane (0 if none)."""
    cap = lanes.lane(lane_bits).capacity
    return cap // ((2 if signed else 1) * world_size)


def summed_allreduce(
    codes: torch.Tensor,
    levels: int,
    group=None,
    *,
    signed: bool = True,
    lane_bits: int | None = None,
    validate: bool = True,
    check: bool = False,
    traffic=None,
) -> torch.Tensor:
    """Exact integer sum over ranks of ``codes`` in [-levels, levels] (or [0, levels]).

    Returns int32 sums of ``codes``' shape. ``validate`` (default) raises ``ValueError`` on
    codes outside the declared range; ``check=True`` adds one small collective verifying
    that every rank passed the same number of elements.
    """
    return summed_allreduce_start(
        codes, levels, group, signed=signed, lane_bits=lane_bits, validate=validate, check=check, traffic=traffic
    ).wait()


def summed_allreduce_start(
    codes: torch.Tensor,
    levels: int,
    group=None,
    *,
    signed: bool = True,
    lane_bits: int | None = None,
    validate: bool = True,
    check: bool = False,
    traffic=None,
) -> g.Pending:
    """:func:`summed_allreduce` launched asynchronously: packs and starts the allreduce;
    ``.wait()`` returns the sums. Launch on every rank in the same order."""
    p = g.world_size(group)

    def check_codes() -> None:
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise TypeError(f"summed_allreduce needs integer codes, got dtype {codes.dtype}")
        if codes.numel() == 0:
            raise ValueError("summed_allreduce got an empty tensor")
        lane_for(p, levels, signed=signed, lane_bits=lane_bits)  # ValueError or OverflowError
        low = -levels if signed else 0
        if validate:
            lo, hi = int(codes.min()), int(codes.max())
            if lo < low or hi > levels:
                raise ValueError(f"summed_allreduce: codes must lie in [{low}, {levels}], got values in [{lo}, {hi}]")

    g.validated(check_codes, codes, group, "summed_allreduce", check, traffic)  # with check, never one rank alone
    n = codes.numel()
    spec = lane_for(p, levels, signed=signed, lane_bits=lane_bits)
    low = -levels if signed else 0

    flat = codes.reshape(-1)
    if spec.word_dtype == torch.uint8:
        # codes + levels lies in [0, 255]: uint8 arithmetic (which wraps modulo 256 on the
        # conversion of negative codes and on the add) gives it exactly, without widening
        shifted = flat.to(torch.uint8).add_(-low % 256)
    else:
        shifted = flat.to(torch.int32) - low
    words = lanes.pack(shifted, spec.bits, validate=False)
    fut = g.all_reduce_sum_async(words, group, f"summed.allreduce.{spec.bits}bit", traffic)

    def finish() -> torch.Tensor:
        return (lanes.unpack(words, spec.bits, n).to(torch.int32) + low * p).view(codes.shape)

    return g.Pending(fut, finish)
