"""1-bit majority vote as a compressed allreduce (Lion Cub Sec. 3, Fig. 1, App. B.1).

Each rank holds a vector x_i; the result on every rank is sign(sum_i sign(x_i)), with
every sign taken to one bit:

1. sign bits of x (exact zeros by the alternating rule), packed 8 per byte;
2. all-to-all: the packed vector is cut into P chunks, chunk r goes to rank r;
3. rank r counts, per element of its chunk, how many ranks voted +1 (k of P) — on the
   packed bytes, with bit-sliced adders (:func:`~lowbit_strategy.codecs.majority_bits`) —
   and takes the majority, +1 if 2k > P, -1 if 2k < P, a tie (2k = P, only for even P) by the
   alternating rule of :mod:`lowbit_strategy.codecs.signs`;
4. the chunk of majority bits is re-packed and all-gathered.

Bandwidth per rank: (P-1)/P·N bits in the all-to-all and (P-1)/P·N bits in the
all-gather, versus 2(P-1)/P·32N for fp32. (Table 1 charges the all-to-all a full N bits;
see :mod:`lowbit_strategy.pricing.flat`.)

Layout: the N bits are zero-padded to P chunks of ``c`` whole bytes each,
``c = ceil(N / (8P))``; padding votes are discarded. With a flag (:func:`majority_vote_start`)
each chunk carries one more byte: the sender's flag.

The two collectives run asynchronously (:func:`majority_vote_start`, then
:meth:`MajorityVote.gather`), so an optimizer can start the all-to-all of every bucket
during backward and finish the votes at its step.
"""

from __future__ import annotations

import torch

from lowbit_strategy.codecs.signs import sign_bits_packed, signs_from_bits, tie_is_positive
from lowbit_strategy.codecs.votes import majority_bits
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
    return majority_vote_start(x, step, group, check=check, validate=validate, traffic=traffic).wait()


class MajorityVote(g.TwoPhase):
    """A majority vote in flight (:func:`majority_vote_start`). Two collectives, the second
    depending on the first's result, so the caller launches the second: :meth:`gather`
    waits for the all-to-all, votes on this rank's chunk and starts the all-gather (call it
    on every rank in the same order as the starts); ``.gather().wait()`` gives the signs.
    :attr:`flags` holds every rank's flag once the all-to-all is done (with ``flag=``).
    :meth:`gather` runs once; later calls return the same pending all-gather."""

    def __init__(self, x, step, group, p, c, flagged, received, fut, traffic):
        self.x, self.step, self.group, self.p, self.c = x, step, group, p, c
        self.flagged, self.received, self.fut, self.traffic = flagged, received, fut, traffic
        self.flags: torch.Tensor | None = None

    def _second_phase(self) -> g.Pending:
        self.fut.wait()
        p, c, stride = self.p, self.c, self.c + self.flagged
        received = self.received.view(p, stride)
        if self.flagged:
            self.flags = received[:, c].to(torch.int32)
        # count the P ranks' votes on the packed bytes themselves (bit-sliced adders)
        mine = majority_bits(received[:, :c], self.step)
        gathered = torch.empty(c * p, dtype=torch.uint8, device=self.x.device)
        fut = g.all_gather_async(gathered, mine, self.group, "majority.all_gather", self.traffic)
        n, x = self.x.numel(), self.x
        return g.Pending(fut, lambda: signs_from_bits(gathered, n, x.dtype).view(x.shape))


def majority_vote_start(
    x: torch.Tensor,
    step: int,
    group=None,
    *,
    flag: torch.Tensor | None = None,
    check: bool = False,
    validate: bool = True,
    traffic=None,
) -> MajorityVote:
    """Encode ``x``'s sign bits and start the all-to-all of :func:`majority_vote`.

    ``flag``: an optional 0/1 uint8 scalar (e.g. "my input has NaN/Inf") that travels with
    the chunks, one extra byte per peer, so that every rank learns every rank's flag from
    the all-to-all without another collective (:attr:`MajorityVote.flags`).
    """

    def check_args() -> None:
        if not x.dtype.is_floating_point:
            raise TypeError(f"majority_vote needs a floating-point tensor, got dtype {x.dtype}")
        if x.numel() == 0:
            raise ValueError("majority_vote got an empty tensor")
        tie_is_positive(step)
        if check and bool(torch.isnan(x).any()):
            raise ValueError("majority_vote: input contains NaN; its sign is undefined")

    g.validated(check_args, x, group, "majority_vote", check, traffic)  # with check, a bad rank never raises alone
    n = x.numel()
    p = g.world_size(group)

    c = chunk_bytes(n, p)
    packed = torch.zeros(c * p, dtype=torch.uint8, device=x.device)
    signs = sign_bits_packed(x, step, check_nan=validate)
    packed[: signs.numel()] = signs
    flagged = int(flag is not None)
    if flag is not None:  # chunk r, then this rank's flag, for every peer r
        packed = torch.cat([packed.view(p, c), flag.to(torch.uint8).reshape(1, 1).expand(p, 1)], dim=1).reshape(-1)
    received = torch.empty_like(packed)
    fut = g.all_to_all_async(received, packed, group, "majority.all_to_all", traffic)
    return MajorityVote(x, step, group, p, c, flagged, received, fut, traffic)
