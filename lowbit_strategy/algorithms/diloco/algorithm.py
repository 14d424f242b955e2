"""DiLoCo behind the algorithm interface: local inner steps, a compressed outer sync.

Inner steps: the user's optimizer (AdamW, Lion, any ``torch.optim.Optimizer``) steps on
gradients that never leave the worker. A worker is a node under the hierarchical topology
(the DDP hook averages gradients inside the node, exactly, as DDP does; FSDP2's
reduce-scatter does it under the sharded front end) and a rank under the flat one (the hook
keeps gradients local). Nothing crosses nodes during inner steps.

Outer sync: after the optimizer steps of :func:`.fragments.syncs_after`, each worker forms
its pseudo-gradient Δ = global − local of the fragment (float32), exchanges it compressed
(:mod:`.exchange`), the mean updates the global weights through the outer Nesterov SGD
(:mod:`.outer`), and the workers continue from the global weights (with ``delay > 0`` from
``alpha·local + (1 − alpha)·global``, ``delay`` steps later). It runs in a post-step hook
of the last optimizer, so every front end drives it by calling ``optimizer.step()``.

A non-finite pseudo-gradient on any worker (inner training diverged) skips that outer
step on every rank: the fragment's global weights stay, every worker restarts from them,
and a warning says so (:attr:`DiLoCoSync.skipped`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from lowbit_strategy.algorithms.base import Algorithm, LowBitSetupError, Sync
from lowbit_strategy.algorithms.diloco import fragments as frag
from lowbit_strategy.algorithms.diloco.config import DiLoCoConfig
from lowbit_strategy.algorithms.diloco.exchange import Exchange, Landing
from lowbit_strategy.algorithms.diloco.outer import Fragment
from lowbit_strategy.algorithms.lion_cub.optimizer import Lion
from lowbit_strategy.algorithms.onebit.adam import OneBitAdam
from lowbit_strategy.algorithms.onebit.lamb import OneBitLamb
from lowbit_strategy.algorithms.turboquant.optimizer import TurboQuantAdamW
from lowbit_strategy.collectives import exact
from lowbit_strategy.collectives.shards import NodeShard
from lowbit_strategy.collectives.wire import TrafficLog
from lowbit_strategy.layout import local_view
from lowbit_strategy.rank_state import to_cpu
from lowbit_strategy.validation import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["ALGORITHM", "DiLoCoSync", "merge_states"]

#: the checkpointed state's format
FORMAT = 1

#: the project's compressed optimizers -> the plain optimizer to use as DiLoCo's inner one
PLAIN: dict[type, str] = {
    Lion: "lion-pytorch's Lion or torch.optim.AdamW",
    OneBitAdam: "torch.optim.Adam (or AdamW)",
    OneBitLamb: "a plain LAMB (or torch.optim.AdamW)",
    TurboQuantAdamW: "torch.optim.AdamW",
}


class DiLoCoSync(Sync):
    """DiLoCo / Streaming DiLoCo for one model (module docstring)."""

    level = "gradient"

    def __init__(self, config, module: torch.nn.Module, group=None):
        super().__init__(config, group)
        self.section: DiLoCoConfig = config.diloco
        self.module = module
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        names = [n for n, _ in named]
        n_blocks = len(frag.blocks(names))
        if self.section.fragments > max(n_blocks, 1):
            raise ConfigError(
                "diloco.fragments",
                self.section.fragments,
                f"at most the model's {n_blocks} blocks (its repeated layers, and each other parameter); "
                "lower fragments",
            )
        device = next((p.device for _, p in named), torch.device("cpu"))
        self.state_device = torch.device("cpu") if self.section.offload == "cpu" else device
        which = frag.fragment_of(names, self.section.fragments)
        self.fragments = [
            Fragment(
                f,
                [p for (_, p), w in zip(named, which) if w == f],
                [n for n, w in zip(names, which) if w == f],
                self.state_device,
            )
            for f in range(self.section.fragments)
        ]
        self.traffic = TrafficLog()
        self.steps = 0  #: optimizer steps taken (the inner step counter, from 1)
        self.syncs = 0  #: fragment syncs landed (rounds done = syncs / fragments)
        self.skipped = 0  #: outer steps skipped because a pseudo-gradient was non-finite
        self.last_norm: float | None = None  #: the last landed mean pseudo-gradient's L2 norm
        self._exchanges: list[Exchange] | None = None
        self._inflight: dict[int, tuple[int, Landing]] = {}  # fragment -> (apply after step, landing)
        self._landed: dict[int, tuple[int, torch.Tensor]] = {}  # restored from a checkpoint, not applied yet
        self._optimizers: list[torch.optim.Optimizer] = []
        self._handles: list[Any] = []

    # ---- inner steps: the DDP hook ------------------------------------------------------
    def gradients_ready(self, params, flat):
        """Inside the node, DDP's exact mean (the hierarchical form); else nothing: gradients
        stay local (flat form; the sharded front end's FSDP2 already averaged the node's)."""
        spec = self.spec
        if isinstance(spec, NodeShard):
            return exact.mean_allreduce_async(flat, spec.topology.intra, "diloco.node_mean", self.node_traffic)
        return None

    # ---- optimizers ----------------------------------------------------------------------
    def attach(self, optimizers: Sequence[torch.optim.Optimizer], who: str = "") -> None:
        for opt in optimizers:
            for cls, plain in PLAIN.items():
                if isinstance(opt, cls):
                    raise LowBitSetupError(
                        f"{who or 'algorithm=diloco'}: the inner optimizer {type(opt).__name__} compresses "
                        f"its own synchronization, which DiLoCo's inner steps never run; use {plain} as the "
                        "inner optimizer"
                    )
        if not optimizers:
            raise LowBitSetupError(f"{who or 'algorithm=diloco'}: DiLoCo needs the inner optimizer; pass it to attach")
        self._optimizers = list(optimizers)
        last = self._optimizers[-1]
        self._handles = [last.register_step_pre_hook(self._before_step), last.register_step_post_hook(self._after_step)]
        mib = 2 * sum(f.n for f in self.fragments) * 4 / 2**20
        logger.info(
            "lowbit: diloco, %s; H=%d, %s, %d fragment(s), delay %d; global copy + outer momentum %.1f MiB on %s",
            self.spec.describe(),
            self.section.sync_every,
            self.section.compression,
            len(self.fragments),
            self.section.delay,
            mib,
            self.state_device,
        )

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _ready(self) -> list[Exchange]:
        if self._exchanges is None:
            s = self.section
            self._exchanges = [
                Exchange(s.compression, s.uses_error_feedback, f.n, self.spec, self.state_device, self.traffic, f.index)
                for f in self.fragments
            ]
        return self._exchanges

    def _before_step(self, *_: Any) -> None:
        for f in self.fragments:
            if f.global_ is None:  # the weights the first inner step starts from: every worker's
                f.snapshot()

    def _after_step(self, *_: Any) -> None:
        self.steps += 1
        t, s = self.steps, self.section
        exchanges = self._ready()
        for f, (apply_at, landing) in list(self._inflight.items()):
            if apply_at == t:
                del self._inflight[f]
                self._land(f, *landing.wait())
            else:
                landing.advance()
        for f, (apply_at, mean) in list(self._landed.items()):
            if apply_at == t:
                del self._landed[f]
                self._land(f, mean, bool(torch.isnan(mean[:1]).any()) if mean.numel() else False, None)
        for fr in self.fragments:
            if frag.syncs_after(t, fr.index, len(self.fragments), s.sync_every):
                landing = exchanges[fr.index].start(fr.pseudo_gradient(), self.syncs)
                if s.delay == 0:
                    self._land(fr.index, *landing.wait())
                else:
                    self._inflight[fr.index] = (t + s.delay, landing)

    def _land(self, index: int, mean: torch.Tensor, bad: bool, norm: float | None) -> None:
        fr, s = self.fragments[index], self.section
        if bad:
            self.skipped += 1
            logger.warning(
                "lowbit: diloco fragment %d after step %d: a worker's pseudo-gradient is non-finite (its inner "
                "training diverged); outer step skipped, every worker restarts from the global weights",
                index,
                self.steps,
            )
            fr.write_back(0.0)
            return
        fr.outer_step(mean, s.outer_lr, s.outer_momentum, s.nesterov)
        fr.write_back(s.alpha if s.delay > 0 else 0.0)
        self.syncs += 1
        self.last_norm = float(mean.norm()) if norm is None else norm

    # ---- what users read -------------------------------------------------------------------
    @property
    def rounds(self) -> float:
        """Rounds done: fragment syncs landed / fragments."""
        return self.syncs / len(self.fragments)

    def metrics(self) -> dict[str, float]:
        out = {"diloco/rounds": self.rounds, "diloco/skipped": float(self.skipped)}
        if self.last_norm is not None:
            out["diloco/pseudo_grad_norm"] = self.last_norm
        return out

    @contextlib.contextmanager
    def global_weights(self) -> Iterator[None]:
        """Evaluate the global weights: inside the block the model holds them (the replicas
        agree), after it each worker's own weights come back. Between rounds a worker's
        weights are its own (``validate`` of Lightning sees rank 0's)."""
        saved = [f.local() for f in self.fragments]
        try:
            for f in self.fragments:
                if f.global_ is not None:
                    f.load_flat(f.global_)
            yield
        finally:
            for f, w in zip(self.fragments, saved):
                f.load_flat(w)

    def traffic_logs(self) -> list[TrafficLog]:
        return [self.traffic, self.node_traffic]

    # ---- checkpoints ------------------------------------------------------------------------
    def algorithm_state_dict(self) -> dict:
        landed = dict(self._landed)
        for f, (apply_at, landing) in self._inflight.items():  # an exchange in flight: its result
            mean, bad, _ = landing.wait()
            landed[f] = (apply_at, torch.full_like(mean, float("nan")) if bad else mean)
        self._inflight = {}
        self._landed = landed
        cpu = lambda t: None if t is None else t.detach().cpu().clone()  # noqa: E731
        return {
            "format": FORMAT,
            "workers": self.spec.world_size,
            "steps": self.steps,
            "syncs": self.syncs,
            "skipped": self.skipped,
            "global": [cpu(f.global_) for f in self.fragments],
            "momentum": [cpu(f.momentum) for f in self.fragments],
            "local": [cpu(f.local()) for f in self.fragments],
            "landed": {f: (a, cpu(m)) for f, (a, m) in landed.items()},
            "errors": [e.state_dict() for e in self._ready()],
            "inner": [to_cpu(opt.state_dict()) for opt in self._optimizers],
        }

    def load_algorithm_state_dict(self, state: dict) -> None:
        if not state:
            return
        if state.get("format") != FORMAT:
            raise ValueError(f"DiLoCo state of format {state.get('format')!r}; this version reads {FORMAT}")
        self.steps, self.syncs, self.skipped = int(state["steps"]), int(state["syncs"]), int(state["skipped"])
        for f, g_, m in zip(self.fragments, state["global"], state["momentum"]):
            if g_ is None:
                continue
            if g_.numel() != f.n:
                raise ValueError(
                    f"DiLoCo fragment {f.index}: {g_.numel()} global weights saved, {f.n} here (another sharding?); "
                    "a sharded run resumes at the same number of ranks per node"
                )
            f.global_ = g_.to(self.state_device, torch.float32).clone()
            f.momentum = m.to(self.state_device, torch.float32).clone()
        self._inflight = {}
        self._landed = {int(f): (int(a), m.to(self.state_device)) for f, (a, m) in state.get("landed", {}).items()}
        exchanges = self._ready()
        if state.get("errors") is not None:
            for e, saved in zip(exchanges, state["errors"]):
                e.load_state_dict(saved)
        else:
            for e in exchanges:
                e.reset_errors()
        local = state.get("local")
        for f, w in zip(self.fragments, local or [None] * len(self.fragments)):
            if w is not None:
                f.load_flat(w.to(self.state_device))
            elif f.global_ is not None:  # another number of workers: continue from the global weights
                f.load_flat(f.global_)
        for opt, saved in zip(self._optimizers, state.get("inner") or []):
            _load_inner(opt, saved)


def _load_inner(opt: torch.optim.Optimizer, saved: dict) -> None:
    """This worker's inner optimizer state, saved as local tensors: copied into the state the
    front end loaded (rank 0's, whose tensors may be FSDP2 ``DTensor`` shards: their local
    parts are overwritten), or loaded whole where the optimizer has no state yet."""
    params = [p for group in opt.param_groups for p in group["params"]]
    states = saved.get("state", {})
    if not all(params[int(i)] in opt.state for i in states):
        opt.load_state_dict(saved)
        return
    with torch.no_grad():
        for i, values in states.items():
            current = opt.state[params[int(i)]]
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and isinstance(current.get(key), torch.Tensor):
                    local_view(current[key]).copy_(value)
                else:
                    current[key] = value


def merge_states(states: list[dict]) -> dict:
    """DiLoCo's state at another number of workers: rank 0's global weights, outer momentum,
    counters and any landed exchange (the same on every worker); every worker continues from
    the global weights with its restored inner optimizer state (rank 0's, as the front end
    loaded it), and the error buffers restart at zero (with a warning: each belonged to one
    worker's part)."""
    first = states[0]
    if not first:
        return {}
    logger.warning(
        "lowbit: diloco restarts at another number of workers: error buffers restart at zero, "
        "every worker continues from the global weights"
    )
    return {**first, "local": None, "errors": None, "inner": None}


ALGORITHM = Algorithm(
    name="diloco",
    section=DiLoCoConfig,
    build=DiLoCoSync,
    strategy_names={"lowbit_diloco": dict(algorithm="diloco")},
    merge_states=merge_states,
    summary="DiLoCo local updates, compressed outer sync (any inner optimizer)",
    hierarchical=True,
    sharded=True,
)
