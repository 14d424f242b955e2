"""1-bit majority vote as a compressed allreduce (Lion Cub Sec. 3, Fig. 1, App. B.1).

Each rank holds a vector x_i; the result on every rank is sign(sum_i sign(x_i)), with
every sign taken to one bit:

1. sign bits of x (exact zeros by the alternating rule), packed 8 per byte;
2. all-to-all: the packed vector is cut into P chunks, chunk r goes to rank r;
3. rank r counts, per element of its chunk, how many ranks voted +1 (k of P) and takes
   the majority, +1 if 2k > P, -1 if 2k < P, a tie (2k = P, only for even P) by the
   alternating rule of :mod:`lowbit_strategy.codecs.signs`;
4. the chunk of majority bits is re-packed and all-gathered.

Bandwidth per rank: (P-1)/P·N bits in the all-to-all and (P-1)/P·N bits in the
all-gather, versus 2(P-1)/P·32N for fp32. (Table 1 charges the all-to-all a full N bits;
see :mod:`.cost_model`.)

Layout: the N bits are zero-padded to P chunks of ``c`` whole bytes each,
``c = ceil(N / (8P))``; padding votes are discarded.
"""
from __future__ import annotations

import torch

from lowbit_strategy.codecs import bits as lanes
from lowbit_strategy.codecs.signs import sign_bits, signs_from_bits, tie_is_positive
from lowbit_strategy.collectives import group as g


def chunk_bytes(n: int, world_size: int) -> int:
    """Bytes of one rank's chunk of an ``n``-element vote (each of the P chunks)."""
    return -(-n // (8 * world_size))


def majority_vote(
    x: torch.Tensor,
    step: int,
    group=None,
    *,
    check: bool = False,
    validate: bool = True,
    traffic=None,
) -> torch.Tensor:
    """The elementwise majority of the ranks' signs of ``x``, as ±1 in ``x``'s dtype/shape.

    ``step`` is the optimizer step (from 1) that drives the alternating tie rule, for the
    local zeros and for tied votes alike. With ``check=True`` one extra small collective
    verifies that every rank passed the same number of elements. ``validate=False`` skips
    the NaN scan, for callers that have excluded non-finite input already.
    """
    if not x.dtype.is_floating_point:
        raise TypeError(f"majority_vote needs a floating-point tensor, got dtype {x.dtype}")
    n = x.numel()
    if n == 0:
        raise ValueError("majority_vote got an empty tensor")
    tie_is_positive(step)
    p = g.world_size(group)
    if check:
        problem = "input contains NaN; its sign is undefined" if bool(torch.isnan(x).any()) else None
        g.check_consistent(x, group, "majority_vote", problem, traffic)

    c = chunk_bytes(n, p)
    padded_n = 8 * c * p
    votes = torch.zeros(padded_n, dtype=torch.uint8, device=x.device)
    votes[:n] = sign_bits(x.reshape(-1), step, check_nan=validate)
    packed = lanes.pack(votes, 1, validate=False)

    received = torch.empty_like(packed)
    g.all_to_all(received, packed, group, "majority.all_to_all", traffic)

    ups = lanes.unpack(received, 1, 8 * c * p).view(p, 8 * c).sum(dim=0, dtype=torch.int32)
    twice = 2 * ups
    winner = twice > p
    if tie_is_positive(step):
        winner |= twice == p
    mine = lanes.pack(winner.to(torch.uint8), 1, validate=False)

    gathered = torch.empty(c * p, dtype=torch.uint8, device=x.device)
    g.all_gather(gathered, mine, group, "majority.all_gather", traffic)

    return signs_from_bits(gathered, n, x.dtype).view(x.shape)
