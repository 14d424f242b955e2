"""The staged optimizers' communicator: one compressed collective per bucket of the
optimizer's fixed layout, started from the DDP hook or at ``step()``, with rank-local
per-bucket state committed only when a step is applied (:mod:`lowbit_strategy.algorithms.staged`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from lowbit_strategy import buckets
from lowbit_strategy.algorithms.staged import state as bucket_state
from lowbit_strategy.algorithms.staged.state import BucketState
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives import wire
from lowbit_strategy.collectives.hierarchy import Topology
from lowbit_strategy.collectives.inflight import InFlight, Launched, finish
from lowbit_strategy.collectives.shards import ShardSpec, spec_for
from lowbit_strategy.layout import Key, Layout

logger = logging.getLogger(__name__)

__all__ = ["BucketCommunicator", "Formed", "Job", "Key"]


@dataclass
class Formed:
    """A bucket's momenta not formed yet: the optimizer writes them straight into the
    communicator's float32 buffer (:meth:`BucketCommunicator._start`) instead of into new
    tensors the buffer then copies: on the CPU one pass and one parameter-sized allocation
    (its page faults) fewer per step.

    ``like``: tensors with the momenta's shapes, dtypes and device, in bucket order (the
    parameters); ``fill(lo, hi, out)`` writes elements ``[lo, hi)`` of the momenta laid end to
    end (:func:`~lowbit_strategy.buckets.flatten_range`'s order) into the float32 ``out``, the
    same floats the formed momenta would convert to."""

    like: list[torch.Tensor]
    fill: Callable[[int, int, torch.Tensor], None]


@dataclass
class Job(Launched):
    """One bucket's collective in flight (:class:`~lowbit_strategy.collectives.inflight.Launched`:
    ``handle.gather() -> .wait()`` gives this rank's part of the flat mean, ``nonfinite()``
    after it)."""

    like: list = field(default_factory=list)  # the momenta sent (shapes and dtypes of the results)
    state: BucketState | None = None  # this step's rank-local state of the bucket, committed on success
    buf: torch.Tensor | None = None  # the buffer the momenta were written to (the communicator's)
    prior: BucketState | None = None  # the bucket's committed state when the step started


class BucketCommunicator:
    """Process group + per-bucket rank-local state: the mean over ranks of each bucket's
    momenta through a compressed collective (subclasses: :meth:`_start_bucket`,
    :meth:`_settled`, :meth:`_released` and :attr:`state_class`).

    Two ways in, with the same result bit for bit: :meth:`launch` from the DDP hook, one
    bucket at a time as backward makes its gradients ready, then :meth:`collect` in
    ``step()``; or :meth:`synchronize` in ``step()``. Buckets are the optimizer's own fixed
    layout (not DDP's, which DDP rebuilds after its first iteration): a compressed result
    depends on which elements share a scale, so a fixed layout keeps overlap on and off,
    and a resumed run, bit for bit the same. A step's new state is only committed
    (:meth:`commit`) once the optimizer applies the step; a skipped step keeps the old one
    (:meth:`discard`).

    Where a bucket's part comes from is the :class:`~lowbit_strategy.collectives.shards.ShardSpec`'s
    business (``spec``; by default the DDP run's, from ``topology``): flat, every rank sends
    the whole bucket; across nodes (:mod:`lowbit_strategy.collectives.hierarchy`) the ranks
    of a node hold the same momenta (the hook averaged their gradients), each sends only its
    shard over its cross-node group, with that shard's state, and the node all-gathers the
    shards' means and their non-finite verdicts. ``group`` and ``world_size`` are then the
    cross-node group and N. The communicator itself only computes a compressed mean of a
    flat buffer over ``spec.group``.

    Buffers persist across steps (a full-size allocation per step costs page faults and
    allocator churn that dwarf the codec's passes on CPU): each bucket's momenta are
    written into a float32 buffer the communicator keeps for that bucket, the subclass may
    make it the bucket's new state (the error feedback ``e' = (x + e) − C[x + e]`` can be
    computed into the buffer holding ``x``, reading the committed ``e`` without writing
    it), and the buffer that state replaces becomes the next step's. So a step's new state
    never overwrites the committed one: :meth:`commit` swaps, :meth:`discard` (a skipped
    step) only drops the new one, and neither copies anything.
    """

    #: name used in log messages
    label = "compressed"
    #: elements that must stay together in one shard across nodes (a scale block)
    shard_align = 64
    #: the per-bucket state this communicator keeps (:mod:`.state`)
    state_class: type[BucketState] = BucketState

    def __init__(
        self,
        group=None,
        bucket_size_mb: float = 25.0,
        debug: bool = False,
        topology: Topology | None = None,
        spec: ShardSpec | None = None,
    ):
        self.topology = topology if topology is not None and topology.hierarchical else None
        #: which part of each bucket this rank sends, over which group, and the way back
        self.spec: ShardSpec = spec if spec is not None else spec_for(group, self.topology)
        #: the group of the compressed collectives: every rank, or this local rank's across nodes
        self.group = self.spec.group
        self.world_size = self.spec.world_size
        #: elements per bucket of the optimizer's fixed layout
        self.bucket_numel = buckets.bucket_numel(bucket_size_mb)
        self.debug = debug
        self.traffic = wire.TrafficLog()
        #: the optimizer's layout (set when it attaches this communicator): checkpoint names
        self.layout: Layout | None = None
        #: per bucket: the committed rank-local state
        self.errors: dict[Key, BucketState] = {}
        self._flight: InFlight[Job] = InFlight()
        self._finished: list[Job] = []
        #: every bucket synchronizes with the exact mean (decided at setup, the same on every
        #: rank): then the DDP hook averages the gradients as DDP does, overlapping backward,
        #: and the optimizer's momenta need no collective (:class:`~.sync.StagedSync`)
        self.exact = False
        #: what the hook sends for the exact mean (``fp32`` or ``bf16``: the exact form's wire)
        self.exact_wire = "fp32"
        #: per bucket: a free float32 buffer of the length this rank sends (the momenta go there)
        self._spare: dict[Key, torch.Tensor] = {}
        #: per bucket: the buffer its results are written to (views of it are returned; read
        #: before the bucket's next collective starts, as ``step()`` does)
        self._results: dict[Key, torch.Tensor] = {}

    # ---- subclass hooks ----------------------------------------------------------------
    def _start_bucket(self, key: Key, flat: torch.Tensor, saved: BucketState | None) -> tuple[BucketState, g.Flagging]:
        """Start the collective of one bucket's flat float32 momenta. ``flat`` is the
        communicator's buffer: the subclass may overwrite it and keep it in the state it
        returns (:meth:`_released` hands it back). ``saved``: the bucket's committed state, or None
        (a new bucket): returns ``(this step's state, handle)``; never modify ``saved`` in
        place (a skipped step keeps it)."""
        raise NotImplementedError

    def _settled(self, state: BucketState, handle: g.Flagging) -> BucketState:
        """This step's state once its collective has finished (some of it is only known then)."""
        return state

    @staticmethod
    def _take(pool: dict[Key, torch.Tensor], key: Key, numel: int, device) -> torch.Tensor:
        """The float32 buffer ``pool`` keeps for bucket ``key`` (removed from it), or a new
        one when it has none of ``numel`` elements on ``device``."""
        buf = pool.pop(key, None)
        if buf is None or buf.numel() != numel or buf.device != torch.device(device):
            buf = torch.empty(numel, dtype=torch.float32, device=device)
        return buf

    def _result_buffer(self, key: Key, like: torch.Tensor) -> torch.Tensor:
        """The bucket's persistent float32 result buffer, ``like``'s length and device."""
        out = self._results[key] = self._take(self._results, key, like.numel(), like.device)
        return out

    def _release(self, job: Job, committed: bool) -> None:
        """``job``'s step is over, its state committed (the previous one superseded) or
        dropped. The buffer its momenta went into is free unless the bucket's state now holds
        it; the state that is no longer the bucket's hands its buffers back
        (:meth:`_released`)."""
        current = self.errors.get(job.key)
        if job.buf is not None and not (current is not None and current.holds(job.buf)):
            self._spare[job.key] = job.buf
        gone = job.prior if committed else job.state
        if gone is not None and gone is not current:
            self._released(job.key, gone)

    def _released(self, key: Key, state: BucketState) -> None:
        """``state`` is no longer bucket ``key``'s: a subclass keeps its buffers (in
        ``self._spare`` the one of ``flat``'s length) for the next step."""

    # ---- one bucket ----------------------------------------------------------------
    def _start(self, key: Key, momenta: Sequence[torch.Tensor] | Formed) -> Job:
        like = momenta.like if isinstance(momenta, Formed) else list(momenta)
        n = sum(m.numel() for m in like)
        lo, hi = self.spec.part(n, self.shard_align)
        sent = hi - lo
        flat = self._take(self._spare, key, max(sent, 1), like[0].device)
        if sent and isinstance(momenta, Formed):
            momenta.fill(lo, hi, flat)
        elif sent:
            buckets.flatten_range(like, lo, hi, out=flat)
        else:  # an empty part still takes part (one zero element, dropped after: shards.pad_empty)
            flat.zero_()
        saved = self.errors.get(key)
        if saved is not None and not saved.fits(flat):
            saved = None
        if saved is None and self.errors:
            logger.info(
                "lowbit: %s bucket %s is new (bucket layout changed); its state starts afresh",
                self.label,
                key[:4] + ((...,) if len(key) > 4 else ()),
            )
        state, handle = self._start_bucket(key, flat, saved)
        return Job(
            key,
            handle,
            like[0].device,
            n,
            self.shard_align,
            like=like,
            state=state,
            buf=flat,
            prior=self.errors.get(key),
        )

    def _finish(self, jobs: Sequence[Job]) -> tuple[list[list[torch.Tensor]], torch.Tensor | None]:
        """Wait for ``jobs`` (:func:`~lowbit_strategy.collectives.inflight.finish`): their
        mean momenta and whether any rank's input to any of them was non-finite, a 0-d bool
        tensor on the device (None for no jobs): the caller reads it once per step."""
        flats, bad = finish(jobs, self.spec, self.traffic)
        results = [buckets.unflatten(flat.view(-1), job.like) for job, flat in zip(jobs, flats)]
        for job in jobs:
            job.state = self._settled(job.state, job.handle)  # type: ignore[arg-type]
        self._finished.extend(jobs)
        return results, bad

    # ---- overlapped with backward --------------------------------------------------
    def launch(self, key: Key, momenta: Sequence[torch.Tensor] | Formed) -> None:
        """Start one bucket's collective (from the communication hook), through the shared
        engine (:class:`~lowbit_strategy.collectives.inflight.InFlight`: stale buckets,
        defer-one)."""

        def drop(stale: Job) -> None:
            self._finish([stale])
            self._finished.remove(stale)
            self._release(stale, committed=False)

        self._flight.launch(key, lambda: self._start(key, momenta), drop)

    def pending(self) -> bool:
        return self._flight.pending()

    def collect(self) -> tuple[dict[Key, list[torch.Tensor]], torch.Tensor | None]:
        """Finish every launched bucket: ``({key: mean momenta}, any rank non-finite)`` (the
        verdict as :meth:`_finish` returns it)."""
        jobs = self._flight.drain()
        results, bad = self._finish(jobs)
        return {job.key: r for job, r in zip(jobs, results)}, bad

    # ---- at step time ----------------------------------------------------------------
    def synchronize(
        self, jobs: Sequence[tuple[Key, Sequence[torch.Tensor] | Formed]]
    ) -> tuple[list[list[torch.Tensor]], torch.Tensor | None]:
        """Mean momenta of each ``(key, momenta)`` bucket (tensors, or :class:`Formed`), in the order given:
        ``(results per bucket, any rank non-finite)``."""
        return self._finish([self._start(key, momenta) for key, momenta in jobs])

    def commit(self) -> None:
        """The step was applied: this step's per-bucket state becomes the state."""
        for job in self._finished:
            self.errors[job.key] = job.state  # type: ignore[assignment]
            self._release(job, committed=True)
        self._finished = []

    def discard(self) -> None:
        """The step was skipped: keep the previous state (nothing to undo: it was never written)."""
        for job in self._finished:
            self._release(job, committed=False)
        self._finished = []

    # ---- rank-local state --------------------------------------------------------------
    def state_dict(self) -> dict:
        """Format 2, keyed by parameter names (:mod:`.state`)."""
        return bucket_state.state_dict(self.errors, self.layout, self.world_size, self.spec.describe())

    def load_state_dict(self, state: dict, device) -> None:
        """Format 2 or 1; state saved for other buffers is not loaded, with the reason logged."""
        self.errors = bucket_state.load_state_dict(
            state, self.state_class, self.layout, self.world_size, self.spec.describe(), device, self.label
        )
