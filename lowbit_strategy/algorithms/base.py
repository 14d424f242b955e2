"""The algorithm interface every front end (plain DDP, Lightning, Accelerate) drives.

An algorithm is one package under :mod:`lowbit_strategy.algorithms` holding its config
section, its optimizer and/or DDP hook, its parameter selection and its per-rank state,
and one :class:`Algorithm` entry in :data:`lowbit_strategy.algorithms.REGISTRY`. A front end
never names an algorithm; it does, for one DDP model:

1. ``algo = REGISTRY[config.algorithm]``; ``algo.check_precision(precision)``;
2. ``sync = algo.build(config, module, group)``: the run's :class:`Sync`, then
   ``sync.topology`` (the node layout, :func:`lowbit_strategy.collectives.hierarchy.resolve`;
   ``integrations/ddp.build_sync`` does both);
3. ``ddp_model.register_comm_hook(sync.hook_state, sync.comm_hook)``;
4. ``sync.attach(optimizers)`` once the optimizers exist (raises :class:`LowBitSetupError`
   naming the fix for an optimizer the algorithm cannot drive);
5. checkpoints: ``sync.state_dict()`` on every rank, gathered keyed by rank
   (:mod:`lowbit_strategy.rank_state`); on resume ``sync.load_state_dict(own)``, or at
   another world size ``sync.load_state_dict(algo.merge_states(all))``;
6. ``sync.traffic_logs()`` for the bytes on the wire; ``sync.detach()`` when training ends.

Three places to synchronize:

* **gradient level** (BitDP): the DDP communication hook returns the (compressed) mean
  gradient of each bucket, and any optimizer steps on it;
* **optimizer level** (Lion Cub): a launch site (DDP's hook through the adapter
  :mod:`~lowbit_strategy.algorithms.ddp_hook`) hands the *local* gradients of the parameters
  that are ready to :meth:`Sync.gradients_ready` during backward, and ``optimizer.step()``
  finishes the synchronization. The default keeps the gradients local and lets the
  optimizer do all the communication in ``step()``; an algorithm that overlaps its
  collective with backward launches it there instead (same order on every rank: DDP hands
  buckets over in the same order everywhere);
* **after the optimizer step, every H steps** (DiLoCo's local updates): the hook keeps
  gradients local (or averages them inside the node), and a post-step hook on the optimizer
  exchanges the pseudo-gradient and applies the outer step.
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook inspects the hook's
# annotations and accepts only the real dist.GradBucket / Future[Tensor] objects.
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lowbit_strategy.algorithms.ddp_hook import bucket_hook, keep_local_gradients
from lowbit_strategy.collectives.hierarchy import Topology
from lowbit_strategy.collectives.shards import ShardSpec, spec_for
from lowbit_strategy.collectives.wire import TrafficLog
from lowbit_strategy.section import Section

__all__ = ["Algorithm", "LowBitSetupError", "Sync", "bucket_hook", "keep_local_gradients", "local_gradients_precision"]


logger = logging.getLogger(__name__)


class LowBitSetupError(RuntimeError):
    """A combination the low-bit synchronization cannot run, found at setup."""


class Sync:
    """What one algorithm does for one DDP model and its optimizers (one training run).

    Subclasses override what applies; the defaults are those of an algorithm with no
    rank-local state that keeps gradients local.
    """

    #: "gradient" (the hook averages gradients) or "optimizer" (the optimizer syncs)
    level: str = "optimizer"
    #: whether synchronization starts from the DDP hook during backward, from gradients as
    #: backward leaves them: then a front end must call :meth:`disable_overlap` before
    #: anything changes gradients between backward and ``optimizer.step()`` (clipping).
    #: Optimizer-level algorithms set it from their config section's ``overlap``; gradient-level
    #: ones keep False (what the hook averages is the gradient the step uses).
    overlap: bool = False

    def __init__(self, config, group: dist.ProcessGroup | None = None):
        self.config = config
        self.group = group
        self.algorithm: Algorithm | None = None  # the registry entry; set by the front end
        #: the node layout (set by the front end, ``build_sync``, before ``attach``); None: flat
        self.topology: Topology | None = None
        #: the bytes of the hierarchical form's intra-node reduction (scope "node")
        self.node_traffic = TrafficLog()
        self._spec: ShardSpec | None = None
        #: rank-local state of the data path outside the algorithm, by name (a front end's
        #: quantized FSDP reduce-scatter with error feedback): objects with ``state_dict()`` and
        #: ``load_state_dict(state)``, saved and restored with the algorithm's
        self.parts: dict[str, Any] = {}

    @property
    def spec(self) -> ShardSpec:
        """Which part of each bucket this rank synchronizes, over which group, and how the
        result comes back (:mod:`lowbit_strategy.collectives.shards`): made on first use from
        :attr:`topology` (set before ``attach``); a data path that shards otherwise sets its own."""
        if self._spec is None:
            self._spec = spec_for(self.group, self.topology)
        return self._spec

    @spec.setter
    def spec(self, spec: ShardSpec) -> None:
        self._spec = spec

    # ---- the DDP communication hook ------------------------------------------------
    @property
    def hook_state(self) -> Any:
        """The ``state`` argument of :attr:`comm_hook`."""
        return self

    @property
    def comm_hook(self) -> Callable:
        """The DDP communication hook ``(state, bucket) -> Future[Tensor]``: the DDP adapter
        (:func:`~lowbit_strategy.algorithms.ddp_hook.bucket_hook`), which hands each bucket
        to :meth:`gradients_ready`; gradient-level algorithms return their own."""
        return bucket_hook

    def gradients_ready(
        self, params: Sequence[torch.Tensor], flat: torch.Tensor
    ) -> torch.futures.Future[torch.Tensor] | None:
        """The local gradients of ``params`` are final (called while backward runs, by a
        launch site: DDP's hook for a bucket, a sharded path's hook for a unit); ``flat``
        holds them all (DDP's bucket buffer, a unit's gradient shard). Return a future of
        ``flat`` averaged in place when the algorithm averages gradients now (the staged
        optimizers' warm-up), or None to keep them local: the default, where the optimizer
        synchronizes in ``step()``. An algorithm that overlaps its collective with backward
        launches it here (the same order on every rank: launch sites call in the same order
        everywhere)."""
        return None

    #: set by a launch site that hands gradients over before they are in ``p.grad`` (FSDP2's
    #: all-reduce hook, which sees the unit's flat shard before FSDP assigns the gradients from
    #: it): :meth:`gradients_ready` then only averages, and the launch site calls
    #: :meth:`launch_ready` once the gradients are assigned
    launch_after_assignment: bool = False

    def launch_ready(self, params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        """The gradients of ``params`` are final and in ``p.grad`` (``flat``: the launch site's
        buffer that held them, for a device-side NaN/Inf verdict): with :attr:`overlap`, start
        their exchange now, while backward goes on. DDP's adapter gets this through
        :meth:`gradients_ready`; the sharded path calls it from FSDP2's post-accumulate-grad
        hooks, after FSDP assigned the unit's gradients. Nothing by default."""

    # ---- optimizers ----------------------------------------------------------------
    def attach(self, optimizers: Sequence[torch.optim.Optimizer], who: str = "") -> None:
        """Check and wire the run's optimizers (raise :class:`LowBitSetupError` naming the
        fix; ``who`` names the front end's setting in that message, e.g. a strategy name)."""

    def detach(self) -> None:
        """Training is over: optimizers become plain single-process optimizers again."""

    def disable_overlap(self, reason: str) -> None:
        """The front end will change gradients between backward and ``optimizer.step()``
        (``reason``, e.g. gradient clipping): an optimizer-level algorithm must then
        synchronize at the step, not from the hook. Gradient-level algorithms ignore it."""

    # ---- telemetry and per-rank state ------------------------------------------------
    def traffic_logs(self) -> list[TrafficLog]:
        return []

    def metrics(self) -> dict[str, float]:
        """The algorithm's own figures for logs and progress bars (DiLoCo's rounds done and
        pseudo-gradient norm), read on the host after a step; none by default."""
        return {}

    def state_dict(self) -> dict:
        """This rank's rank-local state (plain values and CPU tensors), for checkpoints: the
        algorithm's (:meth:`algorithm_state_dict`) and, under ``"parts"``, :attr:`parts`'."""
        state = self.algorithm_state_dict()
        if self.parts:
            state = {**state, "parts": {name: part.state_dict() for name, part in self.parts.items()}}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (or :meth:`Algorithm.merge_states`', which keeps
        no parts: they restart, with a warning)."""
        saved = state.get("parts") or {}
        self.load_algorithm_state_dict({k: v for k, v in state.items() if k != "parts"})
        for name, part in self.parts.items():
            if name in saved:
                part.load_state_dict(saved[name])
            else:
                logger.warning("lowbit: the checkpoint holds no state of %s on this rank: it restarts", name)

    def algorithm_state_dict(self) -> dict:
        """The algorithm's rank-local state (momenta, error buffers); none by default."""
        return {}

    def load_algorithm_state_dict(self, state: dict) -> None:
        """Restore :meth:`algorithm_state_dict`'s output."""


@dataclass(frozen=True)
class local_gradients_precision:  # noqa: N801 - used like a function: check_precision=local_gradients_precision(...)
    """The ``check_precision`` of an algorithm whose gradients stay local (``who`` names its
    optimizers): ``16-mixed`` is refused, since each rank's GradScaler could skip a different
    step and the ranks would hang; the algorithm skips a non-finite step on every rank itself.
    A class, not a closure: the registry entry travels with a strategy pickled to spawned ranks."""

    who: str

    def __call__(self, precision: str | None) -> None:
        if precision == "16-mixed":
            raise LowBitSetupError(
                f"{self.who} keep gradients local and do not support precision='16-mixed': each rank's GradScaler "
                "could skip a different step and the ranks would hang. Use precision='bf16-mixed' or '32-true' "
                "(non-finite steps are skipped on every rank together)."
            )


def _no_merge(states: list) -> dict:
    return {}


def _any_precision(precision: str | None) -> None:
    return None


@dataclass(frozen=True)
class Algorithm:
    """One registry entry: everything a front end needs to know about an algorithm.

    name: the ``LowBitConfig.algorithm`` value; also the name of its config section.
    section: its :class:`~lowbit_strategy.config.Section` subclass.
    build: ``(config, module, group) -> Sync`` for one DDP model (``module`` unwrapped).
    strategy_names: Lightning names -> keyword arguments of ``LowBitStrategy`` (each also
        registered with ``_spawn`` and ``_notebook`` variants).
    merge_states: every saved rank's :meth:`Sync.state_dict` -> the state a rank of another
        world size loads (the front end logs a warning when it uses it).
    check_precision: raises :class:`LowBitSetupError` for a precision it cannot run.
    summary: one line for the strategy registry's description.
    optimizer: the optimizer class an optimizer-level algorithm drives (``Lion``,
        ``OneBitAdam``, ...), which front ends that build the optimizer themselves (the
        Hugging Face ``Trainer``) construct; None: any optimizer (gradient-level algorithms).
    warmup_argument: the name of that optimizer's full-precision warm-up argument
        (``freeze_step``, ``warmup_steps``), or None when it has none.
    hierarchical: whether its :class:`Sync` runs the hierarchical (node-aware) form when
        :attr:`Sync.topology` says so (:mod:`lowbit_strategy.collectives.hierarchy`); without
        it, ``topology='auto'`` stays flat and ``'hierarchical'`` is refused at setup.
    sharded: whether it runs on a model ``fully_shard``-ed inside each node
        (:func:`lowbit_strategy.attach_sharded`: its state per shard, its exchange across nodes).
    coded_warmup: whether ``LowBitConfig(warmup_wire="int2")`` codes its warm-up (the staged
        optimizers': :mod:`lowbit_strategy.algorithms.staged.warmup_codes`); the config refuses
        ``int2`` for the others, which have no warm-up of their own to code.
    """

    name: str
    section: type[Section]
    build: Callable[..., Sync]
    strategy_names: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    merge_states: Callable[[list], dict] = _no_merge
    check_precision: Callable[[str | None], None] = _any_precision
    summary: str = ""
    optimizer: type[torch.optim.Optimizer] | None = None
    warmup_argument: str | None = None
    hierarchical: bool = False
    sharded: bool = False
    coded_warmup: bool = False
