"""BitDP's two-stage form: a reduce-scatter of 1/2-bit codes, a server re-encoding with
error feedback, an all-gather; bytes per rank flat in P.

The all-gather form (:mod:`.gathered`) sends every rank's whole payload to every peer:
``(P-1)·(W + 4R)`` bytes per rank for ``W`` code bytes and ``R`` scales, more than a float32
ring allreduce past ``P ≈ 64/b``. The two-stage form sends ``≈ 2(P-1)/P·(W + 4R)``:

1. *worker*: each rank channel-encodes its whole payload as in the all-gather form (codes
   + one float32 scale per row), cuts it into P chunks **at whole-row boundaries** (a row's
   scale stays with its codes) and sends chunk r to rank r (``all_to_all_single``, of codes
   and of scales: gloo has no reduce-scatter);
2. *server*: rank r decodes the P versions of its own chunk and averages them, exactly as
   the all-gather form does (:func:`~.gathered.decode_reduce`: ``Σ_i q_i·(s_i/P)`` in the
   fixed order of :func:`~lowbit_strategy.codecs.reduce.rank_sum`); adds its
   ``server_error`` (float32, one per element of its chunk, rank-local), re-encodes the
   result ``y`` with the same channel codec (one new scale per row) and keeps
   ``server_error ← y − s ⊙ q`` (what this step could not deliver goes with the next);
3. all-gather of every server's codes and scales; every rank decodes all P chunks: the
   same float32 operations on every rank, so every rank ends bit-identical.

**Chunk split** (:func:`row_bounds`, deterministic, per matrix): each matrix's rows are
cut into P contiguous ranges, rank r owning rows ``[⌊r·R_k/P⌋, ⌊(r+1)·R_k/P⌋)`` of matrix
k (all rows of a matrix have the same width, so this balances its elements to within one
row); chunk r is rank r's ranges of every matrix, in matrix order (each such *piece* packed
on its own, zero-padded to whole bytes, as a matrix is in the all-gather form). Per matrix,
not per payload: which rows of a parameter a rank owns — and so its server error — depends
only on the parameter's shape and P, never on which parameters share a DDP bucket (DDP's
first iteration after a restart runs on provisional buckets; a payload-wide split would
make a resumed run differ). A chunk is within one row per matrix of ``N/P`` elements. A
matrix with fewer rows than ranks gives some ranks none of its rows, and a chunk may get
**zero rows** (every matrix shorter than P): its rank receives and sends padding only,
keeps an empty ``server_error`` and still relays the non-finite flag. Every record on the
wire is padded to the largest chunk (``W_max`` code bytes, ``R_max`` scales), as
equal-split collectives need.

Bytes per rank (sent = received): ``2·(P-1)·(W_max + 4·(R_max + f))`` with ``f = 1`` when a
non-finite flag travels (the hook always sends one), ``≈ 2(P-1)/P·(W + 4R)``
(:func:`lowbit_strategy.pricing.flat.bitdp_bytes`, checked against the traffic in
the tests).

**Non-finite input**: ``flag`` (a device-side bool of this rank) travels beside each chunk's
scales; every server sees every rank's flag, relays "any" beside its own scales, so the
result is ``(mean, any_flag)``, the verdict the same on every rank with no host read. Where
it is set the server keeps its ``server_error`` unchanged (a device-side ``where``).

**Ordering** (NCCL rules, :mod:`.emulation`): stage 2 needs stage 1's data and must be
launched in the same order on every rank, so :meth:`GatheredTwoStage.gather` (called by the
launching thread, never from a callback) waits for the all-to-alls' own futures, runs the
server step and launches the all-gathers; the returned future is chained (``then``) from
the last all-gather and waits the other one's own future inside. On NCCL those waits order
the stream (no host sync); on gloo the caller's thread waits for stage 1's transfer.
Every function reads the world size and rank from the group it is given.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd.profiler import record_function

from lowbit_strategy import _moved
from lowbit_strategy.codecs import bits as lanes
from lowbit_strategy.codecs.channel import channel_encode_many
from lowbit_strategy.collectives import chain
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.gathered import (
    DEFAULT_CHUNK_ROWS,
    PayloadLayout,
    check_chunk_rows,
    decode_reduce,
    pack_payload,
)
from lowbit_strategy.validation import check_int

_WHAT = "gathered_two_stage_mean"


def row_bounds(rows: int, world_size: int) -> tuple[int, ...]:
    """The ``P + 1`` row boundaries of one matrix of ``rows`` rows (module docstring, "Chunk
    split"): rank r owns rows ``[⌊r·rows/P⌋, ⌊(r+1)·rows/P⌋)``."""
    check_int("row_bounds", "world_size", world_size, 1)
    return tuple(r * rows // world_size for r in range(world_size + 1))


@dataclass(frozen=True)
class Chunking:
    """How a payload laid out as ``layout`` is cut into ``world_size`` chunks.

    ``pieces[r]``: chunk r's ``(matrix, first row, end row)`` pieces; ``words`` / ``rows`` /
    ``numel``: per chunk, packed code bytes, scales, elements; ``max_words`` / ``max_rows``:
    the record every chunk is padded to. Build it with :func:`chunking`."""

    layout: PayloadLayout
    world_size: int
    pieces: tuple[tuple[tuple[int, int, int], ...], ...]
    words: tuple[int, ...]
    rows: tuple[int, ...]
    numel: tuple[int, ...]
    max_words: int
    max_rows: int

    def chunk_layout(self, r: int) -> PayloadLayout | None:
        """Chunk r's own layout (its pieces as matrices), None for a zero-row chunk."""
        if not self.pieces[r]:
            return None
        return PayloadLayout.of([(b - a, self.layout.shapes[k][1]) for k, a, b in self.pieces[r]], self.layout.bits)

    def gathered_layout(self, flagged: bool) -> PayloadLayout:
        """The P gathered records read as one payload: every piece in order, at its padded
        record's offsets (chunk r's codes at ``r·max_words``, scales at ``r·(max_rows+f)``)."""
        spec, s = lanes.lane(self.layout.bits), self.max_rows + flagged
        shapes, wo, ro, eo, e = [], [], [], [], 0
        for r, pieces in enumerate(self.pieces):
            w, q = r * self.max_words, r * s
            for k, a, b in pieces:
                cols = self.layout.shapes[k][1]
                shapes.append((b - a, cols))
                wo.append(w)
                ro.append(q)
                eo.append(e)
                w, q, e = w + spec.words_for((b - a) * cols), q + b - a, e + (b - a) * cols
        return PayloadLayout(
            self.layout.bits,
            tuple(shapes),
            tuple(wo),
            tuple(ro),
            tuple(eo),
            self.world_size * self.max_words,
            self.world_size * s,
            self.layout.numel,
        )

    def wire_bytes(self, flagged: bool = True) -> int:
        """Bytes one rank sends (= receives): ``2·(P-1)·(max_words + 4·(max_rows + f))``."""
        return 2 * (self.world_size - 1) * (self.max_words + 4 * (self.max_rows + flagged))


@functools.lru_cache(maxsize=256)
def chunking(layout: PayloadLayout, world_size: int) -> Chunking:
    """The :class:`Chunking` of ``layout`` over ``world_size`` ranks (cached: the layout is
    immutable and DDP's buckets repeat every step)."""
    spec = lanes.lane(layout.bits)
    bounds = [row_bounds(r, world_size) for r, _ in layout.shapes]
    pieces, words, rows, numel = [], [], [], []
    for r in range(world_size):
        mine = tuple((k, b[r], b[r + 1]) for k, b in enumerate(bounds) if b[r + 1] > b[r])
        pieces.append(mine)
        words.append(sum(spec.words_for((b - a) * layout.shapes[k][1]) for k, a, b in mine))
        rows.append(sum(b - a for _, a, b in mine))
        numel.append(sum((b - a) * layout.shapes[k][1] for k, a, b in mine))
    return Chunking(layout, world_size, tuple(pieces), tuple(words), tuple(rows), tuple(numel), max(words), max(rows))


def server_error_length(layout: PayloadLayout, group=None) -> int:
    """Elements of this rank's chunk: the length of its ``server_error``."""
    return chunking(layout, g.world_size(group)).numel[g.rank(group)]


def server_error_for(layout: PayloadLayout, group=None, device=None) -> torch.Tensor:
    """A zero ``server_error`` for this rank of ``group`` (float32, possibly empty)."""
    return torch.zeros(server_error_length(layout, group), dtype=torch.float32, device=device)


def _piece_views(out, layout: PayloadLayout, plan: Chunking) -> list[torch.Tensor]:
    """``out`` (flat, or one tensor per matrix) as one flat view per piece, in chunk order."""
    if isinstance(out, torch.Tensor):
        if out.numel() != layout.numel or out.dtype != torch.float32:
            raise ValueError(f"out must hold {layout.numel} float32 elements, got {out.numel()} {out.dtype}")
        mats = [out.view(-1)[e : e + r * c] for e, (r, c) in zip(layout.elem_offsets, layout.shapes)]
    else:
        mats = list(out)
        if len(mats) != len(layout.shapes) or any(
            m.numel() != r * c or m.dtype != torch.float32 for m, (r, c) in zip(mats, layout.shapes)
        ):
            raise ValueError("out must be one float32 tensor per matrix, sized rows * cols")
    return [mats[k].view(layout.shapes[k])[a:b].view(-1) for pieces in plan.pieces for k, a, b in pieces]


def _check(codes, scales, layout: PayloadLayout, server_error: torch.Tensor, plan: Chunking, rank: int) -> None:
    if len(codes) != len(layout.shapes) or len(scales) != len(layout.shapes):
        raise ValueError(
            f"{_WHAT}: layout has {len(layout.shapes)} matrices, got {len(codes)} codes / {len(scales)} scales"
        )
    for k, (c, s, (r, n)) in enumerate(zip(codes, scales, layout.shapes)):
        if c.numel() != r * n or s.numel() != r or c.dtype != torch.uint8:
            raise ValueError(
                f"{_WHAT}: matrix {k} needs {r * n} uint8 lane codes and {r} scales (channel_encode's output), "
                f"got {c.numel()} {c.dtype} / {s.numel()}"
            )
    want = plan.numel[rank]
    if (
        not isinstance(server_error, torch.Tensor)
        or server_error.dtype != torch.float32
        or server_error.numel() != want
        or not server_error.is_contiguous()
    ):
        raise ValueError(
            f"{_WHAT}: server_error must be a contiguous float32 tensor of this rank's chunk, {want} elements "
            "(server_error_for(layout, group))"
        )


class GatheredTwoStage:
    """A two-stage mean in flight (:func:`gathered_two_stage_start`): stage 1 launched.
    :meth:`gather` (once; on every rank in launch order, never from a callback) runs the
    server step and launches stage 2, returning the result's future; :meth:`wait` is
    ``gather().wait()``."""

    def __init__(
        self, plan, rank, group, server_error, got_words, got_scales, futures, flagged, chunk_rows, out, traffic
    ):
        self.plan, self._rank, self._group, self._server_error = plan, rank, group, server_error
        self._got: tuple[torch.Tensor, torch.Tensor] | None = (got_words, got_scales)
        self._futures, self._flagged = futures, flagged
        self._chunk_rows, self._out, self._traffic = chunk_rows, out, traffic
        self._future: torch.futures.Future | None = None

    def gather(self) -> torch.futures.Future:
        if self._future is None:
            self._future = self._second_phase()
        return self._future

    def wait(self):
        return self.gather().wait()

    def _server(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This rank's record of stage 2: its chunk's mean (+ server error) re-encoded,
        padded, and (flagged) whether any rank raised its flag."""
        plan, p, layout = self.plan, self.plan.world_size, self.plan.layout
        s = plan.max_rows + self._flagged
        assert self._got is not None  # (stage 1's buffers, until stage 2 is launched)
        got_words, got_scales = self._got[0].view(p, plan.max_words), self._got[1].view(p, s)
        raised = got_scales[:, plan.max_rows].sum() > 0 if self._flagged else None
        words = torch.zeros(plan.max_words, dtype=torch.uint8, device=got_words.device)
        scales = torch.zeros(s, dtype=torch.float32, device=got_words.device)
        mine = plan.chunk_layout(self._rank)
        if mine is not None:
            y = torch.empty(mine.numel, dtype=torch.float32, device=got_words.device)
            decode_reduce(
                got_words[:, : mine.words], got_scales[:, : mine.rows], mine, chunk_rows=self._chunk_rows, out=y
            )
            y.add_(self._server_error)
            views = [y[e : e + r * c].view(r, c) for e, (r, c) in zip(mine.elem_offsets, mine.shapes)]
            enc = channel_encode_many(views, layout.bits, decode=True, validate=False)  # equal widths at once
            w, sc = pack_payload([c for c, _, _ in enc], [x for _, x, _ in enc], mine)
            words[: mine.words], scales[: mine.rows] = w, sc
            err = y.sub_(torch.cat([d.reshape(-1) for _, _, d in enc if d is not None]))  # (decode=True: all)
            if raised is not None:  # a flagged step leaves the server error as it was
                err = torch.where(raised, self._server_error, err)
            self._server_error.copy_(err)
        if raised is not None:
            scales[plan.max_rows] = raised.to(torch.float32)
        return words, scales, raised

    def _second_phase(self) -> torch.futures.Future:
        for f in self._futures:
            f.wait()  # each all-to-all's own wait: its data is there (re-raises a failure)
        with record_function("lowbit.server:gathered.two_stage"):
            words, scales, _ = self._server()
        plan, p, group, traffic = self.plan, self.plan.world_size, self._group, self._traffic
        every_words = torch.empty(p * plan.max_words, dtype=torch.uint8, device=words.device)
        every_scales = torch.empty(p * scales.numel(), dtype=torch.float32, device=words.device)
        f_words = g.all_gather_async(every_words, words, group, "gathered.two_stage.codes.all_gather", traffic)
        f_scales = g.all_gather_async(every_scales, scales, group, "gathered.two_stage.scales.all_gather", traffic)
        self._futures, self._got = (), None
        flagged, chunk_rows, out, layout = self._flagged, self._chunk_rows, self._out, plan.layout

        def finish(_: torch.futures.Future):  # chained from the scales' all-gather: its data is there
            with record_function("lowbit.callback:gathered.two_stage.decode"):
                f_words.wait()  # the codes' own wait (launched first)
                result = torch.empty(layout.numel, dtype=torch.float32, device=words.device) if out is None else out
                decode_reduce(
                    every_words.view(1, -1), every_scales.view(1, -1), plan.gathered_layout(flagged),
                    chunk_rows=chunk_rows, out=_piece_views(result, layout, plan),
                )  # fmt: skip
                if not flagged:
                    return result
                return result, every_scales.view(p, -1)[:, plan.max_rows].sum() > 0

        return chain.then(f_scales, finish)


def gathered_two_stage_start(
    codes: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    layout: PayloadLayout,
    server_error: torch.Tensor,
    group=None,
    *,
    chunk_rows: int | None = DEFAULT_CHUNK_ROWS,
    out=None,
    traffic=None,
    flag: torch.Tensor | None = None,
) -> GatheredTwoStage:
    """Launch stage 1 of the two-stage mean (module docstring) of this rank's payload:
    ``codes`` / ``scales``, one per matrix of ``layout``, the unpacked lane codes and scales
    of :func:`~lowbit_strategy.codecs.channel_encode`; ``server_error`` this rank's (updated
    in place by :meth:`GatheredTwoStage.gather`); ``out`` as in
    :func:`~.gathered.decode_reduce`; ``flag`` as in :func:`~.gathered.gathered_mean_async`."""
    check_chunk_rows(chunk_rows)
    p, rank = g.world_size(group), g.rank(group)
    plan = chunking(layout, p)
    _check(codes, scales, layout, server_error, plan, rank)
    flagged = flag is not None
    s = plan.max_rows + flagged
    device = codes[0].device
    words = torch.zeros(p * plan.max_words, dtype=torch.uint8, device=device)
    scl = torch.zeros(p, s, dtype=torch.float32, device=device)
    flat_codes = [c.reshape(-1) for c in codes]
    flat_scales = [x.reshape(-1).float() for x in scales]
    spec = lanes.lane(layout.bits)
    for r, pieces in enumerate(plan.pieces):  # one pack per piece: about matrices + P of them
        w, q = r * plan.max_words, 0
        for k, a, b in pieces:
            cols = layout.shapes[k][1]
            n = spec.words_for((b - a) * cols)
            words[w : w + n] = lanes.pack(flat_codes[k][a * cols : b * cols], layout.bits, validate=False)
            scl[r, q : q + b - a] = flat_scales[k][a:b]
            w, q = w + n, q + b - a
    if flag is not None:
        scl[:, plan.max_rows] = flag.to(torch.float32)
    got_words, got_scales = torch.empty_like(words), torch.empty(p * s, dtype=torch.float32, device=device)
    f_words = g.all_to_all_async(got_words, words, group, "gathered.two_stage.codes.all_to_all", traffic)
    f_scales = g.all_to_all_async(got_scales, scl.view(-1), group, "gathered.two_stage.scales.all_to_all", traffic)
    return GatheredTwoStage(
        plan, rank, group, server_error, got_words, got_scales, (f_words, f_scales), flagged, chunk_rows, out, traffic
    )


def gathered_two_stage_mean(
    codes: Sequence[torch.Tensor],
    scales: Sequence[torch.Tensor],
    layout: PayloadLayout,
    server_error: torch.Tensor,
    group=None,
    *,
    chunk_rows: int | None = DEFAULT_CHUNK_ROWS,
    out=None,
    traffic=None,
    flag: torch.Tensor | None = None,
):
    """Blocking two-stage mean: the flat float32 mean (or ``out``), bit-identical on every
    rank; with ``flag``, ``(result, any_flag)``. Arguments: :func:`gathered_two_stage_start`."""
    return gathered_two_stage_start(
        codes, scales, layout, server_error, group, chunk_rows=chunk_rows, out=out, traffic=traffic, flag=flag
    ).wait()


#: renamed in 0.3 ("plan" names the planner), still served with a warning
__getattr__ = _moved.attribute_aliases(
    __name__,
    {
        "ChunkPlan": "lowbit_strategy.collectives.gathered_two_stage.Chunking",
        "chunk_plan": "lowbit_strategy.collectives.gathered_two_stage.chunking",
    },
)
