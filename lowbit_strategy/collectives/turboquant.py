"""TurboQuant collectives: the rank mean of a float vector sent as TurboQuant codes.

The two synchronizations of "TurboQuant-Adam", both built on
:class:`~lowbit_strategy.codecs.turboquant.TurboQuantCodec` (``bits``-bit Lloyd–Max codes
of the Hadamard-rotated vector + one float32 scale per codec block). With P ranks, an
``n``-element vector, ``k(m)`` code bytes for ``m`` elements (``ceil(m·lane/8)``: ``m/2``
at 4 bits) and ``nb(m) = ceil(m / block)`` scales:

**All-gather form** (Algorithm 1; :func:`turboquant_allgather_mean`): every rank encodes
its whole vector, all-gathers the codes and the scales, decodes all P payloads and sums
them in rank order, then divides by P: ``mean = (d_0 + d_1 + … + d_{P−1}) / P``, the same
float32 operations on every rank, so the result is bit-identical everywhere. Bytes per
rank (sent = received): ``(P−1)·(k(n) + 4·nb(n))``: 8x below a float32 ring allreduce
(``2(P−1)/P·4n``) at P = 2, 4x at P = 4, and *more* than it past P = 16 (2x at P = 32).
No state, no error feedback (a caller may keep its own, as the paper's optimizer does).
``scale=`` is passed to the encode (the codec's rules: one value or ``nb(n)`` values;
every rank must pass the same kind, so that every rank sends as many scales).

**Two-stage form** (:func:`turboquant_two_stage_mean`): bytes ~8x below float32 at any P,
the same pattern as the error-compensated 1-bit allreduce (:mod:`.compensated`):

1. *worker*: the vector, padded with zeros, is cut into P chunks of ``c`` elements; each
   chunk is encoded on its own (a payload of ``c`` elements);
2. *all-to-all* of the codes and of the scales: rank r receives every rank's chunk r;
3. *server*: rank r decodes the P payloads, sums them in rank order and divides by P,
   adds its ``server_error`` (float32, ``c`` elements, this rank's own), encodes the
   result ``y`` again and keeps ``server_error ← y − decode(encode(y))`` (error feedback of
   the re-encoding: what this call could not deliver is sent with the next);
4. *all-gather* of the server codes and scales; every rank decodes all P chunks.

Bytes per rank: ``2·(P−1)·(k(c) + 4·nb(c))`` ≈ ``2(P−1)/P·(n/2 + 4n/block)`` at 4 bits,
1/8 of the float32 ring allreduce plus ``1/(8·block)·32`` of it for the scales.

Layout and padding (two-stage): :func:`turboquant_server_chunk_length` gives
``c = block·ceil(n / (P·block))`` when ``n ≥ P·block`` (whole codec blocks: no rotation
block or scale group straddles two chunks, and every group but the last chunk's tail is
a full one), else ``c = 8·ceil(n / (8P))`` (a vector shorter than P blocks: each chunk is
one partial block; a multiple of 8 so every code lane fills whole bytes). Rank r owns
elements ``[r·c, (r+1)·c)``; the padding (``P·c − n`` zeros, fewer than ``P·block``, so
negligible for buckets of many blocks but up to ~2x the bytes when ``n`` is just above
``P·block``) is encoded with the real elements of the last chunk(s) (a chunk of padding
only has scale 0 and decodes to zeros) and dropped at the end. The server zeroes the
padding of its mean before encoding and ``server_error``'s padding entries stay 0.

**Worker error feedback** (both forms, optional; the optimizer's momentum-level error
compensation, "TurboQuant-Adam" Algorithm 1): with ``worker_error`` (float32, ``n``
elements, this rank's own) the vector sent is ``u = x + worker_error``, and after the call
``worker_error = u − decode(encode(u))``: what this rank's codes could not carry is added to
its next call. In the all-gather form the decode is the one the mean needs anyway (this
rank's row); in the two-stage form it is one more decode of this rank's chunks, run while
the all-to-all is on the wire.

**Given scales** (both forms): ``scale=`` replaces the per-block RMS of the worker encode
(an optimizer keeping an EMA of the scale passes it): the codec's rules, for the
all-gather form ``1`` or ``nb(n)`` values; for the two-stage form ``1`` or ``P·nb(c)``
values, chunk ``r``'s groups at ``[r·nb(c), (r+1)·nb(c))`` (:func:`turboquant_scale_groups`
gives both layouts). The server's re-encoding always uses the RMS of its mean.

Arithmetic is float32 (the codec's); the result is float32 rounded to ``x``'s dtype.
With ``P = 1`` nothing is sent and the same arithmetic runs.

Non-finite input: a NaN or inf in rank i's vector gives a non-finite scale in rank i's
payload (the codec's RMS). In the all-gather form every rank sees it in
:attr:`TurboQuantAllgather.scales`; in the two-stage form it makes the server's mean
non-finite in that block, hence its server scale, and
:attr:`TurboQuantTwoStage.server_scales` (gathered, identical on every rank) is
non-finite on every rank: ``torch.isfinite(scales).all()`` is the same verdict
everywhere, an agreement on "skip this step" with no extra collective. The server error
of that block becomes non-finite too: pass a copy if a skipped step must not move it.
"""
from __future__ import annotations

import torch

from lowbit_strategy.codecs.scaled_signs import check_error_buffer, check_input
from lowbit_strategy.codecs.turboquant import TurboQuantCodec, TurboQuantPayload
from lowbit_strategy.collectives import group as g

_AG = "turboquant_allgather_mean"
_TS = "turboquant_two_stage_mean"


def turboquant_server_chunk_length(n: int, world_size: int, block: int) -> int:
    """Elements of each rank's chunk in the two-stage form, padding included (the length
    of ``server_error``): ``block·ceil(n/(P·block))`` if ``n ≥ P·block``, else
    ``8·ceil(n/(8P))`` (module docstring, "Layout and padding")."""
    for name, value in (("n", n), ("world_size", world_size), ("block", block)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"turboquant_server_chunk_length: {name} must be a positive int, got {value!r}")
    if n >= world_size * block:
        return block * -(-n // (world_size * block))
    return 8 * -(-n // (8 * world_size))


def turboquant_server_error(x: torch.Tensor, codec: TurboQuantCodec, group=None) -> torch.Tensor:
    """A zero ``server_error`` for the two-stage mean of vectors like ``x`` on this rank of
    ``group``: float32 on ``x``'s device, :func:`turboquant_server_chunk_length` elements."""
    check_input(x, "x", "turboquant_server_error")
    _check_codec(codec, "turboquant_server_error")
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


def _check_codec(codec, what: str) -> None:
    if not isinstance(codec, TurboQuantCodec):
        raise TypeError(f"{what}: codec must be a TurboQuantCodec, got {type(codec).__name__}")


def _check_x(x, codec, what: str) -> None:
    check_input(x, "x", what)
    _check_codec(codec, what)
    if x.numel() == 0:
        raise ValueError(f"{what}: x is empty")


def _validated(validate, x, group, what: str, check: bool, traffic) -> None:
    """Run ``validate()``; with ``check`` every rank learns about a bad rank or a length
    mismatch (one small all-gather) and all of them raise together."""
    try:
        validate()
    except (TypeError, ValueError) as e:
        if not check:
            raise
        problem = e
    else:
        problem = None
    if check:
        try:
            mine = x if isinstance(x, torch.Tensor) else torch.empty(0)
            g.check_consistent(mine, group, what, None if problem is None else str(problem), traffic)
        except ValueError:
            if problem is not None:
                raise problem from None
            raise


def _payload(codec: TurboQuantCodec, codes: torch.Tensor, scales: torch.Tensor, m: int) -> TurboQuantPayload:
    return TurboQuantPayload(codes, scales, torch.Size([m]), torch.float32, m, codec.bits, codec.block)


def rank_ordered_mean(codec: TurboQuantCodec, codes: torch.Tensor, scales: torch.Tensor, m: int,
                      own: tuple[int, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``(d_0 + … + d_{P−1}) / P`` over the P payloads of ``m`` elements held as rows of
    ``codes`` (P, k) and ``scales`` (P, nb), decoded in rank order: float32, ``m`` elements.
    ``own = (i, u, error)``: also ``error ← u − d_i`` (row ``i`` is this rank's encoding of
    ``u``), from the decode the mean needs anyway."""
    p = codes.shape[0]
    acc = None
    for i in range(p):
        d = codec.decode(_payload(codec, codes[i], scales[i], m))
        if own is not None and own[0] == i:
            torch.sub(own[1], d, out=own[2])
        acc = d if acc is None else acc.add_(d)
    return acc.div_(p)


def _with_error(x: torch.Tensor, worker_error: torch.Tensor | None) -> torch.Tensor:
    """What a rank sends: ``x + worker_error`` in float32 (a new tensor), or ``x``."""
    if worker_error is None:
        return x
    return x.reshape(-1).to(torch.float32) + worker_error


# -- all-gather form -----------------------------------------------------------------------


class TurboQuantAllgather:
    """A :func:`turboquant_allgather_mean` in flight: :meth:`wait` returns the mean (and
    updates ``worker_error`` when one was given).

    :attr:`scales` (after the wait): float32 ``(P, nb)``, row i = rank i's scales, the same
    on every rank; non-finite where any rank's input was."""

    def __init__(self, x, codec, p, k, codes, scales, futures, own=None):
        self._shape, self._dtype, self._n = x.shape, x.dtype, x.numel()
        self._codec, self._p, self._k = codec, p, k
        self._codes, self._all_scales, self._futures, self._own = codes, scales, futures, own
        self._result: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None

    def gather(self) -> "TurboQuantAllgather":
        """Itself: one phase only (the interface of the two-phase collectives, :class:`~.group.TwoPhase`)."""
        return self

    def wait(self) -> torch.Tensor:
        """The mean over ranks (``x``'s shape and dtype); later calls return the same tensor."""
        if self._result is None:
            for f in self._futures:
                f.wait()  # re-raises a failed collective
            codes = self._codes.view(self._p, self._k)
            scales = self._all_scales.view(self._p, -1)
            self.scales = scales
            mean = rank_ordered_mean(self._codec, codes, scales, self._n, self._own)
            self._result = mean.to(self._dtype).view(self._shape)
            self._codes = self._futures = self._own = None
        return self._result


def _check_worker_error(worker_error, x, what: str) -> None:
    if worker_error is not None:
        check_error_buffer(worker_error, x.numel(), x.device, "worker_error", what, "x.numel()")


def turboquant_allgather_mean_start(
    x: torch.Tensor, codec: TurboQuantCodec, group=None, *, scale=None, worker_error: torch.Tensor | None = None,
    check: bool = False, traffic=None,
) -> TurboQuantAllgather:
    """Start :func:`turboquant_allgather_mean`: encode ``x`` (+ ``worker_error``; ``x`` is
    no longer needed after this returns) and launch the all-gathers of codes and scales,
    asynchronously. ``worker_error`` is updated by the wait."""

    def validate() -> None:
        _check_x(x, codec, _AG)
        _check_worker_error(worker_error, x, _AG)

    if not check:
        validate()
    p = g.world_size(group)
    _validated(validate, x, group, _AG, check, traffic)
    u = _with_error(x, worker_error)
    payload = codec.encode(u, scale)
    k, nb = payload.codes.numel(), payload.scales.numel()
    codes = torch.empty(p * k, dtype=torch.uint8, device=x.device)
    scales = torch.empty(p * nb, dtype=torch.float32, device=x.device)
    f_codes = g.all_gather_async(codes, payload.codes, group, "turboquant.codes", traffic)
    f_scales = g.all_gather_async(scales, payload.scales.reshape(-1), group, "turboquant.scales", traffic)
    own = None if worker_error is None else (g.rank(group), u, worker_error.view(-1))
    return TurboQuantAllgather(x, codec, p, k, codes, scales, (f_codes, f_scales), own)


def turboquant_allgather_mean(
    x: torch.Tensor, codec: TurboQuantCodec, group=None, *, scale=None, worker_error: torch.Tensor | None = None,
    check: bool = False, traffic=None,
) -> torch.Tensor:
    """The mean over the ranks of ``group`` of ``x`` (any shape, not modified), every rank's
    vector sent as ``codec`` codes + scales by one all-gather (module docstring). Returns
    ``x``'s shape and dtype, bit-identical on every rank. ``scale``: as
    :meth:`TurboQuantCodec.encode` (None: the RMS of every block). ``worker_error``: this
    rank's error feedback (float32, ``x.numel()`` elements, contiguous, updated in place;
    module docstring). ``check=True`` adds one small collective that makes every rank
    raise when any rank passed a different length or invalid arguments (without it a rank
    raising alone leaves its peers waiting until the group's timeout)."""
    return turboquant_allgather_mean_start(x, codec, group, scale=scale, worker_error=worker_error, check=check,
                                           traffic=traffic).wait()


# -- two-stage form ------------------------------------------------------------------------


class TurboQuantTwoStage(g.TwoPhase):
    """A :func:`turboquant_two_stage_mean` in flight (:func:`turboquant_two_stage_mean_start`).

    :meth:`gather` waits for the all-to-all, runs the server step on this rank's chunk
    (updating ``server_error``) and starts the all-gathers (call it on every rank in the
    same order as the starts; never from a future's callback); ``.gather().wait()`` — or
    :meth:`wait` — returns the result.

    :attr:`worker_scales` (after :meth:`gather`): ``(P, nb)``, row i = rank i's scales of
    *this* rank's chunk (differs from rank to rank). :attr:`server_scales` (after the
    wait): ``(P, nb)``, row r = chunk r's server scales, identical on every rank; non-finite
    on every rank when any rank's input was (module docstring).
    """

    def __init__(self, x, codec, server_error, group, p, rank, c, k, nb, codes, scales, futures, traffic):
        self._shape, self._dtype, self._n = x.shape, x.dtype, x.numel()
        self._codec, self._server_error, self._group = codec, server_error, group
        self._p, self._rank, self._c, self._k, self._nb = p, rank, c, k, nb
        self._codes, self._scales, self._futures, self._traffic = codes, scales, futures, traffic
        self.worker_scales: torch.Tensor | None = None
        self.server_scales: torch.Tensor | None = None

    def _second_phase(self) -> g.Pending:
        """Finish phase one, run the server step, start phase two (:meth:`gather` runs it once)."""
        for f in self._futures:
            f.wait()  # re-raises a failed collective
        p, c, k, nb, n, codec = self._p, self._c, self._k, self._nb, self._n, self._codec
        self.worker_scales = self._scales.view(p, nb)
        mean = rank_ordered_mean(codec, self._codes.view(p, k), self.worker_scales, c)
        real = max(0, min(c, n - c * self._rank))  # elements of this chunk that are not padding
        err = self._server_error.view(-1)
        mean[real:] = 0
        mean[:real].add_(err[:real])
        payload = codec.encode(mean)
        err[:real] = mean[:real] - codec.decode(payload)[:real]
        every_codes = torch.empty(p * k, dtype=torch.uint8, device=mean.device)
        every_scales = torch.empty(p * nb, dtype=torch.float32, device=mean.device)
        f_codes = g.all_gather_async(every_codes, payload.codes, self._group, "turboquant.server_codes",
                                     self._traffic)
        f_scales = g.all_gather_async(every_scales, payload.scales.reshape(-1), self._group,
                                      "turboquant.server_scales", self._traffic)
        shape, dtype = self._shape, self._dtype

        def finish() -> torch.Tensor:
            f_codes.value()  # re-raise either failure
            f_scales.value()
            self.server_scales = every_scales.view(p, nb)
            codes = every_codes.view(p, k)
            chunks = [codec.decode(_payload(codec, codes[r], self.server_scales[r], c)) for r in range(p)]
            return torch.cat(chunks)[:n].to(dtype).view(shape)

        pending = g.Pending(torch.futures.collect_all([f_codes, f_scales]), finish)
        self._futures = self._codes = self._scales = None
        return pending


def encode_chunks(x: torch.Tensor, codec: TurboQuantCodec, p: int, c: int, scale=None):
    """``x`` zero-padded to ``P·c`` elements, each chunk of ``c`` encoded on its own: the
    payloads in chunk order (the worker step of the two-stage form). ``scale``: None (the
    RMS of every group), one value for every chunk, or ``P·nb(c)`` values (chunk r's at
    ``[r·nb(c), (r+1)·nb(c))``)."""
    n = x.numel()
    buf = torch.zeros(p * c, dtype=torch.float32, device=x.device)
    buf[:n] = x.reshape(-1)
    return [codec.encode(buf[r * c:(r + 1) * c], _chunk_scale(scale, p, r)) for r in range(p)]


def _chunk_scale(scale, p: int, r: int):
    if scale is None or not isinstance(scale, torch.Tensor) or scale.numel() == 1:
        return scale
    return scale.reshape(p, -1)[r]


def _check_chunk_scale(scale, p: int, c: int, block: int) -> None:
    if isinstance(scale, torch.Tensor) and scale.numel() not in (1, p * -(-c // block)):
        raise ValueError(f"{_TS}: scale must hold 1 or P·ceil(c / block) = {p * -(-c // block)} values "
                         f"(turboquant_scale_groups), got {scale.numel()}")


def turboquant_two_stage_mean_start(
    x: torch.Tensor, codec: TurboQuantCodec, server_error: torch.Tensor, group=None, *,
    scale=None, worker_error: torch.Tensor | None = None, check: bool = False, traffic=None,
) -> TurboQuantTwoStage:
    """Start :func:`turboquant_two_stage_mean`: encode this rank's chunks of ``x`` (+
    ``worker_error``; ``x`` is no longer needed after this returns), launch the all-to-alls
    of codes and scales, then update ``worker_error`` while they run. ``server_error`` is
    updated, and phase two launched, by :meth:`TurboQuantTwoStage.gather`."""
    if not check:
        _check_x(x, codec, _TS)
    p = g.world_size(group)

    def validate() -> None:
        _check_x(x, codec, _TS)
        c = turboquant_server_chunk_length(x.numel(), p, codec.block)
        check_error_buffer(server_error, c, x.device, "server_error", _TS,
                           f"turboquant_server_chunk_length(x.numel(), P={p}, block={codec.block})")
        if not server_error.is_contiguous():
            raise ValueError(f"{_TS}: server_error must be contiguous")
        _check_worker_error(worker_error, x, _TS)
        _check_chunk_scale(scale, p, c, codec.block)

    if not check:
        validate()
    _validated(validate, x, group, _TS, check, traffic)
    n = x.numel()
    c = turboquant_server_chunk_length(n, p, codec.block)
    rank = g.rank(group)
    u = _with_error(x, worker_error)
    payloads = encode_chunks(u, codec, p, c, scale)
    k, nb = payloads[0].codes.numel(), payloads[0].scales.numel()
    codes = torch.cat([q.codes for q in payloads])
    scales = torch.cat([q.scales.reshape(-1) for q in payloads])
    got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
    f_codes = g.all_to_all_async(got_codes, codes, group, "turboquant.chunk_codes", traffic)
    f_scales = g.all_to_all_async(got_scales, scales, group, "turboquant.chunk_scales", traffic)
    if worker_error is not None:  # this rank's own decode, while the all-to-all is on the wire
        sent = torch.cat([codec.decode(q) for q in payloads])[:n]
        torch.sub(u, sent, out=worker_error.view(-1))
    del payloads
    return TurboQuantTwoStage(x, codec, server_error, group, p, rank, c, k, nb, got_codes, got_scales,
                              (f_codes, f_scales), traffic)


def turboquant_two_stage_mean(
    x: torch.Tensor, codec: TurboQuantCodec, server_error: torch.Tensor, group=None, *,
    scale=None, worker_error: torch.Tensor | None = None, check: bool = False, traffic=None,
) -> torch.Tensor:
    """The mean over the ranks of ``group`` of ``x`` (any shape, not modified) by the
    two-stage TurboQuant collective (module docstring): all-to-all of encoded chunks,
    server re-encoding with error feedback into ``server_error`` (float32, contiguous,
    :func:`turboquant_server_chunk_length` elements, updated in place; start it as
    :func:`turboquant_server_error`), all-gather. Returns ``x``'s shape and dtype,
    bit-identical on every rank. ``scale`` (worker groups, :func:`turboquant_scale_groups`)
    and ``worker_error``: module docstring. ``check``: as in :func:`turboquant_allgather_mean`."""
    return turboquant_two_stage_mean_start(x, codec, server_error, group, scale=scale, worker_error=worker_error,
                                           check=check, traffic=traffic).wait()
