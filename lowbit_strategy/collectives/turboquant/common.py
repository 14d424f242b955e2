"""What both TurboQuant collectives share: the two-stage chunk layout, the scale groups,
argument checks, and the rank-ordered mean of P payloads (:mod:`lowbit_strategy.collectives.turboquant`)."""

from __future__ import annotations

import torch

from lowbit_strategy.codecs.reduce import rank_sum
from lowbit_strategy.codecs.scaled_signs import check_error_buffer, check_input
from lowbit_strategy.codecs.turboquant import TurboQuantCodec, TurboQuantPayload
from lowbit_strategy.codecs.turboquant_rows import decode_rows
from lowbit_strategy.collectives import group as g
from lowbit_strategy.validation import check_int


def turboquant_server_chunk_length(n: int, world_size: int, block: int) -> int:
    """Elements of each rank's chunk in the two-stage form, padding included (the length
    of ``server_error``): ``block·ceil(n/(P·block))`` if ``n ≥ P·block``, else
    ``8·ceil(n/(8P))`` (module docstring, "Layout and padding")."""
    for name, value in (("n", n), ("world_size", world_size), ("block", block)):
        check_int("turboquant_server_chunk_length", name, value, 1)
    if n >= world_size * block:
        return block * -(-n // (world_size * block))
    return 8 * -(-n // (8 * world_size))


def turboquant_server_error(x: torch.Tensor, codec: TurboQuantCodec, group=None) -> torch.Tensor:
    """A zero ``server_error`` for the two-stage mean of vectors like ``x`` on this rank of
    ``group``: float32 on ``x``'s device, :func:`turboquant_server_chunk_length` elements."""
    check_input(x, "x", "turboquant_server_error")
    check_codec(codec, "turboquant_server_error")
    n = x.numel()
    if n == 0:
        raise ValueError("turboquant_server_error: x is empty")
    c = turboquant_server_chunk_length(n, g.world_size(group), codec.block)
    return torch.zeros(c, dtype=torch.float32, device=x.device)


def turboquant_scale_groups(n: int, world_size: int, block: int, two_stage: bool) -> tuple[int, int]:
    """``(padded_length, group_size)`` of the worker encode's scale groups: the vector,
    zero-padded to ``padded_length``, is cut into groups of ``group_size`` consecutive
    elements (the last one partial in the all-gather form), one scale each, in the order
    ``scale=`` takes them. All-gather form: ``(n, block)``; two-stage form:
    ``(P·c, min(block, c))`` with ``c`` :func:`turboquant_server_chunk_length` (``c`` is a
    multiple of ``block`` or a single partial group, so no group straddles two chunks)."""
    if not two_stage:
        return n, block
    c = turboquant_server_chunk_length(n, world_size, block)
    return world_size * c, min(block, c)


def check_codec(codec, what: str) -> None:
    if not isinstance(codec, TurboQuantCodec):
        raise TypeError(f"{what}: codec must be a TurboQuantCodec, got {type(codec).__name__}")


def check_x(x, codec, what: str) -> None:
    check_input(x, "x", what)
    check_codec(codec, what)
    if x.numel() == 0:
        raise ValueError(f"{what}: x is empty")


def payload_of(codec: TurboQuantCodec, codes: torch.Tensor, scales: torch.Tensor, m: int) -> TurboQuantPayload:
    return TurboQuantPayload(codes, scales, torch.Size([m]), torch.float32, m, codec.bits, codec.block)


def rank_ordered_mean(
    codec: TurboQuantCodec,
    codes: torch.Tensor,
    scales: torch.Tensor,
    m: int,
    own: tuple[int, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``(d_0 + … + d_{P−1}) / P`` over the P payloads of ``m`` elements held as rows of
    ``codes`` (P, k) and ``scales`` (P, nb), summed in the ranks' fixed order
    (:func:`~lowbit_strategy.codecs.reduce.rank_sum`): float32, ``m`` elements. Every row is
    decoded at once (:func:`~lowbit_strategy.codecs.turboquant_rows.decode_rows`): a number
    of kernels that does not grow with P. ``own = (i, u, error)``: also ``error ← u − d_i``
    (row ``i`` is this rank's encoding of ``u``), from the decode the mean needs anyway."""
    p = codes.shape[0]
    if p == 0:
        raise ValueError("rank_ordered_mean needs at least one payload (codes of shape (P, k), P >= 1)")
    decoded = decode_rows(codec, codes, scales, m)
    if own is not None:
        torch.sub(own[1], decoded[own[0]], out=own[2])
    return rank_sum(decoded).div(p)


def with_error(x: torch.Tensor, worker_error: torch.Tensor | None) -> torch.Tensor:
    """What a rank sends: ``x + worker_error`` in float32 (a new tensor), or ``x``."""
    if worker_error is None:
        return x
    return x.reshape(-1).to(torch.float32) + worker_error


def check_worker_error(worker_error, x, what: str) -> None:
    if worker_error is not None:
        check_error_buffer(worker_error, x.numel(), x.device, "worker_error", what, "x.numel()")
