"""The two-stage form of the TurboQuant mean: all-to-all of encoded chunks, a server
re-encoding with error feedback, all-gather; bytes per rank flat in P
(:mod:`lowbit_strategy.collectives.turboquant` has the layout, the bytes and the rules)."""

from __future__ import annotations

import torch

from lowbit_strategy.codecs.scaled_signs import check_error_buffer
from lowbit_strategy.codecs.turboquant import TurboQuantCodec
from lowbit_strategy.codecs.turboquant_rows import decode_rows, encode_rows
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.turboquant.common import (
    check_worker_error,
    check_x,
    payload_of,
    rank_ordered_mean,
    turboquant_server_chunk_length,
    with_error,
)

_TS = "turboquant_two_stage_mean"


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

    def nonfinite(self) -> torch.Tensor:
        """After the wait: whether any rank's input was non-finite (it made the server scales so)."""
        return g.nonfinite(self.server_scales, "TurboQuantTwoStage")

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
        f_codes = g.all_gather_async(every_codes, payload.codes, self._group, "turboquant.server_codes", self._traffic)
        f_scales = g.all_gather_async(
            every_scales, payload.scales.reshape(-1), self._group, "turboquant.server_scales", self._traffic
        )
        shape, dtype = self._shape, self._dtype

        def finish() -> torch.Tensor:  # after both collectives' own wait() (Pending)
            self.server_scales = every_scales.view(p, nb)
            chunks = decode_rows(codec, every_codes.view(p, k), self.server_scales, c)  # every chunk at once
            return chunks.view(-1)[:n].to(dtype).view(shape)

        pending = g.Pending([f_codes, f_scales], finish)
        self._futures = self._codes = self._scales = None
        return pending


def encode_chunks(x: torch.Tensor, codec: TurboQuantCodec, p: int, c: int, scale=None):
    """``x`` zero-padded to ``P·c`` elements, each chunk of ``c`` encoded on its own: the
    payloads in chunk order (the worker step of the two-stage form). ``scale``: None (the
    RMS of every group), one value for every chunk, or ``P·nb(c)`` values (chunk r's at
    ``[r·nb(c), (r+1)·nb(c))``)."""
    codes, scales = _encode_chunk_rows(x, codec, p, c, scale)
    return [payload_of(codec, codes[r], scales[r], c) for r in range(p)]


def _encode_chunk_rows(x: torch.Tensor, codec: TurboQuantCodec, p: int, c: int, scale=None):
    """:func:`encode_chunks` as ``(codes (P, k), scales (P, nb))``, every chunk at once
    (:func:`~lowbit_strategy.codecs.turboquant_rows.encode_rows`)."""
    n = x.numel()
    buf = torch.zeros(p * c, dtype=torch.float32, device=x.device)
    buf[:n] = x.reshape(-1)
    return encode_rows(codec, buf.view(p, c), scale)


def _check_chunk_scale(scale, p: int, c: int, block: int) -> None:
    if isinstance(scale, torch.Tensor) and scale.numel() not in (1, p * -(-c // block)):
        raise ValueError(
            f"{_TS}: scale must hold 1 or P·ceil(c / block) = {p * -(-c // block)} values "
            f"(turboquant_scale_groups), got {scale.numel()}"
        )


def turboquant_two_stage_mean_start(
    x: torch.Tensor,
    codec: TurboQuantCodec,
    server_error: torch.Tensor,
    group=None,
    *,
    scale=None,
    worker_error: torch.Tensor | None = None,
    check: bool = False,
    traffic=None,
) -> TurboQuantTwoStage:
    """Start :func:`turboquant_two_stage_mean`: encode this rank's chunks of ``x`` (+
    ``worker_error``; ``x`` is no longer needed after this returns), launch the all-to-alls
    of codes and scales, then update ``worker_error`` while they run. ``server_error`` is
    updated, and phase two launched, by :meth:`TurboQuantTwoStage.gather`."""

    def validate() -> None:
        check_x(x, codec, _TS)  # first: it needs no process group
        p = g.world_size(group)
        c = turboquant_server_chunk_length(x.numel(), p, codec.block)
        check_error_buffer(
            server_error,
            c,
            x.device,
            "server_error",
            _TS,
            f"turboquant_server_chunk_length(x.numel(), P={p}, block={codec.block})",
        )
        if not server_error.is_contiguous():
            raise ValueError(f"{_TS}: server_error must be contiguous")
        check_worker_error(worker_error, x, _TS)
        _check_chunk_scale(scale, p, c, codec.block)

    g.validated(validate, x, group, _TS, check, traffic)
    p = g.world_size(group)
    n = x.numel()
    c = turboquant_server_chunk_length(n, p, codec.block)
    rank = g.rank(group)
    u = with_error(x, worker_error)
    rows, row_scales = _encode_chunk_rows(u, codec, p, c, scale)
    k, nb = rows.shape[1], row_scales.shape[1]
    codes, scales = rows.reshape(-1), row_scales.reshape(-1)
    got_codes, got_scales = torch.empty_like(codes), torch.empty_like(scales)
    f_codes = g.all_to_all_async(got_codes, codes, group, "turboquant.chunk_codes", traffic)
    f_scales = g.all_to_all_async(got_scales, scales, group, "turboquant.chunk_scales", traffic)
    if worker_error is not None:  # this rank's own decode, while the all-to-all is on the wire
        sent = decode_rows(codec, rows, row_scales, c).view(-1)[:n]
        torch.sub(u, sent, out=worker_error.view(-1))
    return TurboQuantTwoStage(
        x, codec, server_error, group, p, rank, c, k, nb, got_codes, got_scales, (f_codes, f_scales), traffic
    )


def turboquant_two_stage_mean(
    x: torch.Tensor,
    codec: TurboQuantCodec,
    server_error: torch.Tensor,
    group=None,
    *,
    scale=None,
    worker_error: torch.Tensor | None = None,
    check: bool = False,
    traffic=None,
) -> torch.Tensor:
    """The mean over the ranks of ``group`` of ``x`` (any shape, not modified) by the
    two-stage TurboQuant collective (module docstring): all-to-all of encoded chunks,
    server re-encoding with error feedback into ``server_error`` (float32, contiguous,
    :func:`turboquant_server_chunk_length` elements, updated in place; start it as
    :func:`turboquant_server_error`), all-gather. Returns ``x``'s shape and dtype,
    bit-identical on every rank. ``scale`` (worker groups, :func:`turboquant_scale_groups`)
    and ``worker_error``: module docstring. ``check``: as in :func:`turboquant_allgather_mean`."""
    return turboquant_two_stage_mean_start(
        x, codec, server_error, group, scale=scale, worker_error=worker_error, check=check, traffic=traffic
    ).wait()
