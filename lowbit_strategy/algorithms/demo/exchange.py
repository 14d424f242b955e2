"""DeMo's exchange: one worker's momenta -> its payload (the codec) -> every worker's payload
(the collective) -> the per-coefficient mean, back in each parameter's domain.

:class:`Exchange` runs it over the run's :class:`~lowbit_strategy.collectives.shards.ShardSpec`
(the workers: ranks in the flat form, nodes in the hierarchical and sharded ones) with
:class:`~lowbit_strategy.collectives.payloads.PayloadGather`; without a communicator the
optimizer uses one over a single worker (nothing on the wire), so single-process DeMo runs
the same codec. The codec (:class:`~lowbit_strategy.codecs.topk.TopKCodec`) is built on first
use from the tensors' shapes (a sharded run's local shards) and kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lowbit_strategy.codecs.topk import TopKCodec
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.group import Waitable
from lowbit_strategy.collectives.payloads import PayloadGather
from lowbit_strategy.collectives.shards import ShardSpec
from lowbit_strategy.collectives.wire import TrafficLog

__all__ = ["Exchange", "Flight", "Landed"]


@dataclass
class Flight:
    """One step's exchange, launched: ``handle.wait()`` gives the ``(workers, bytes)`` payloads
    (byte 0 of each: that worker's non-finite flag, so this worker's own verdict comes back with
    everyone's, without a host read at launch); ``lrs`` / ``wds``: the learning rate and weight
    decay of each parameter at launch; ``sent``: what this worker removed from its momenta
    (kept while in memory; decoded from the payloads after a restart)."""

    handle: Waitable
    lrs: list[float]
    wds: list[float]
    sent: list[torch.Tensor] | None = None
    gathered: torch.Tensor | None = None

    def payloads(self) -> torch.Tensor:
        if self.gathered is None:
            self.gathered = self.handle.wait()
        return self.gathered


class Landed:
    """Payloads already here (``(workers, bytes)``): a single worker's own, or an exchange
    restored from a checkpoint."""

    def __init__(self, payloads: torch.Tensor):
        self.payloads = payloads

    def wait(self) -> torch.Tensor:
        return self.payloads


class Exchange:
    """The exchange of one optimizer's parameters (module docstring).

    values: the codec's value code; spec: the workers (None: a single worker);
    traffic: where the collective's bytes are recorded; debug: :meth:`verify` checks that
    the workers' weights agree after every applied update (``LowBitConfig.debug``).
    """

    def __init__(
        self, values: str, spec: ShardSpec | None = None, traffic: TrafficLog | None = None, debug: bool = False
    ):
        self.values, self.spec, self.debug = values, spec, debug
        self.traffic = traffic if traffic is not None else TrafficLog()
        self.codec: TopKCodec | None = None
        #: the last launch's share of the momenta's energy sent (a 0-d tensor on the device)
        self.energy: torch.Tensor | None = None

    @property
    def workers(self) -> int:
        return 1 if self.spec is None else self.spec.world_size

    @property
    def worker(self) -> int:
        """This worker's row in the gathered payloads."""
        return 0 if self.spec is None else g.rank(self.spec.group)

    def codec_for(self, tensors: Sequence[torch.Tensor], chunk: int, topk: int) -> TopKCodec:
        if self.codec is None:
            device = tensors[0].device if tensors else torch.device("cpu")
            self.codec = TopKCodec([tuple(t.shape) for t in tensors], chunk, topk, self.values, device)
        return self.codec

    def start(self, momenta: Sequence[torch.Tensor], bad: torch.Tensor, lrs: list[float], wds: list[float]) -> Flight:
        """Encode this worker's ``momenta`` (flagged by ``bad``, a 0-d bool tensor: its gradient
        was non-finite) with the codec :meth:`codec_for` built, and launch the gather."""
        codec = self.codec
        assert codec is not None, "codec_for() builds the codec first"
        payload, sent, self.energy = codec.encode(momenta, bad)
        if self.spec is None or self.spec.world_size == 1:
            handle: Waitable = Landed(payload.unsqueeze(0))
        else:
            handle = PayloadGather(payload, self.spec, "demo.all_gather", self.traffic)
        return Flight(handle, lrs, wds, sent)

    def land(self, flight: Flight, like: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor] | None, bool]:
        """``(the mean update per parameter, or None when any worker flagged its payload: the
        step is skipped on every worker; whether this worker's own payload was flagged)``. One
        host read (the flags), in ``step()``."""
        gathered = flight.payloads()
        codec = self.codec
        assert codec is not None
        flags = codec.flags(gathered).tolist()
        # restored at another number of workers: no row of its own (nothing to put back)
        own_bad = flags[self.worker] if len(flags) == self.workers else True
        bad = any(flags)
        if self.spec is not None:
            bad = self.spec.agree(bad)  # a sharded node's ranks hold different shards: OR them
        return (None if bad else codec.mean(gathered, like)), own_bad

    def own(self, flight: Flight, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """What this worker sent in ``flight``: kept, or decoded from the gathered payloads."""
        assert self.codec is not None
        if flight.sent is not None:
            return flight.sent
        return self.codec.decode_one(flight.payloads()[self.worker], like)

    def verify(self, params: Sequence[torch.Tensor]) -> None:
        """With ``debug``: every worker's weights (this rank's shards of them) are the same after
        the update, checked by one small all-gather of per-parameter float64 sums (identical
        replicas give identical sums, bit for bit); a difference raises on every worker alike."""
        if not self.debug or self.spec is None or self.workers == 1:
            return
        mine = torch.stack([p.detach().double().sum() for p in params]) if params else torch.zeros(1)
        every = torch.empty(self.workers * mine.numel(), dtype=mine.dtype, device=mine.device)
        g.all_gather(every, mine, self.spec.group, "demo.debug.replicas", self.traffic)
        rows = every.view(self.workers, -1)
        differ = [w for w in range(1, self.workers) if not torch.equal(rows[w], rows[0])]
        if differ:
            raise RuntimeError(
                f"DeMo (debug): the weights of worker(s) {differ} differ from worker 0's after the step: the replicas "
                "diverged (every worker applies the same update by construction; report this with the run's config)"
            )
