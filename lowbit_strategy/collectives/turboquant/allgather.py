"""The all-gather form of the TurboQuant mean (Algorithm 1 of "TurboQuant-Adam"): every rank
encodes its whole vector, all-gathers codes and scales, and decodes all P payloads in rank
order (:mod:`lowbit_strategy.collectives.turboquant` has the bytes and the rules)."""

from __future__ import annotations

import torch

from lowbit_strategy.codecs.turboquant import TurboQuantCodec
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.turboquant.common import check_worker_error, check_x, rank_ordered_mean, with_error

_AG = "turboquant_allgather_mean"


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

    def nonfinite(self) -> torch.Tensor:
        """After the wait: whether any rank's input was non-finite (every rank's scales are here)."""
        return g.nonfinite(self.scales, "TurboQuantAllgather")

    def gather(self) -> TurboQuantAllgather:
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


def turboquant_allgather_mean_start(
    x: torch.Tensor,
    codec: TurboQuantCodec,
    group=None,
    *,
    scale=None,
    worker_error: torch.Tensor | None = None,
    check: bool = False,
    traffic=None,
) -> TurboQuantAllgather:
    """Start :func:`turboquant_allgather_mean`: encode ``x`` (+ ``worker_error``; ``x`` is
    no longer needed after this returns) and launch the all-gathers of codes and scales,
    asynchronously. ``worker_error`` is updated by the wait."""

    def validate() -> None:
        check_x(x, codec, _AG)
        check_worker_error(worker_error, x, _AG)

    g.validated(validate, x, group, _AG, check, traffic)  # arguments first: they need no process group
    p = g.world_size(group)
    u = with_error(x, worker_error)
    payload = codec.encode(u, scale)
    k, nb = payload.codes.numel(), payload.scales.numel()
    codes = torch.empty(p * k, dtype=torch.uint8, device=x.device)
    scales = torch.empty(p * nb, dtype=torch.float32, device=x.device)
    f_codes = g.all_gather_async(codes, payload.codes, group, "turboquant.codes", traffic)
    f_scales = g.all_gather_async(scales, payload.scales.reshape(-1), group, "turboquant.scales", traffic)
    own = None if worker_error is None else (g.rank(group), u, worker_error.view(-1))
    return TurboQuantAllgather(x, codec, p, k, codes, scales, (f_codes, f_scales), own)


def turboquant_allgather_mean(
    x: torch.Tensor,
    codec: TurboQuantCodec,
    group=None,
    *,
    scale=None,
    worker_error: torch.Tensor | None = None,
    check: bool = False,
    traffic=None,
) -> torch.Tensor:
    """The mean over the ranks of ``group`` of ``x`` (any shape, not modified), every rank's
    vector sent as ``codec`` codes + scales by one all-gather (module docstring). Returns
    ``x``'s shape and dtype, bit-identical on every rank. ``scale``: as
    :meth:`TurboQuantCodec.encode` (None: the RMS of every block). ``worker_error``: this
    rank's error feedback (float32, ``x.numel()`` elements, contiguous, updated in place;
    module docstring). ``check=True`` adds one small collective that makes every rank
    raise when any rank passed a different length or invalid arguments (without it a rank
    raising alone leaves its peers waiting until the group's timeout)."""
    return turboquant_allgather_mean_start(
        x, codec, group, scale=scale, worker_error=worker_error, check=check, traffic=traffic
    ).wait()
