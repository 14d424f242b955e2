"""DeMo behind the algorithm interface: an optimizer-level :class:`~..base.Sync`.

Gradients stay with the worker: the DDP hook sends nothing across nodes (in the hierarchical
form it first takes the node's exact mean, :func:`~lowbit_strategy.algorithms.ddp_hook.bucket_hook`,
so a worker is a node; in the flat form a rank; under :func:`lowbit_strategy.attach_sharded`
FSDP2's reduce-scatter does it and each rank runs DeMo on its shards with its counterparts on
the other nodes). Each :class:`~.optimizer.DeMo` gets an :class:`~.exchange.Exchange` over the
run's workers and, in ``step()``, sends the top-k DCT coefficients of its momenta
(:mod:`lowbit_strategy.codecs.topk`) and steps by the sign of their mean.

Rank-local state for checkpoints: every optimizer's ``state`` (each worker's own momenta δ),
and with ``delay = 1`` the exchange in flight (waited for, its gathered payloads saved: a
resume applies it at the next step, bit for bit).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from lowbit_strategy.algorithms.base import Algorithm, LowBitSetupError, Sync, local_gradients_precision
from lowbit_strategy.algorithms.demo.config import DeMoConfig
from lowbit_strategy.algorithms.demo.exchange import Exchange, Flight, Landed
from lowbit_strategy.algorithms.demo.optimizer import DeMo
from lowbit_strategy.collectives.wire import TrafficLog
from lowbit_strategy.layout import dtensor_state_
from lowbit_strategy.rank_state import mean_states, to_cpu

logger = logging.getLogger(__name__)

__all__ = ["ALGORITHM", "DeMoSync", "merge_states"]

#: the checkpointed state's format
FORMAT = 1


class DeMoSync(Sync):
    level = "optimizer"

    def __init__(self, config, module: torch.nn.Module, group=None):
        super().__init__(config, group)
        self.section: DeMoConfig = config.demo
        self.optimizers: list[DeMo] = []
        self.traffic = TrafficLog()

    def attach(self, optimizers: Sequence[torch.optim.Optimizer], who: str = "") -> None:
        for opt in optimizers:
            if not isinstance(opt, DeMo):
                raise LowBitSetupError(
                    f"{who or 'LowBitConfig(algorithm=demo)'} drives lowbit_strategy.DeMo, but got "
                    f"{type(opt).__module__}.{type(opt).__name__}: the pair (algorithm demo, "
                    f"{type(opt).__name__}) would never synchronize gradients. Use lowbit_strategy.DeMo(...), "
                    "or another algorithm for this optimizer (bitdp keeps any optimizer)."
                )
        if not optimizers:
            raise LowBitSetupError(f"{who or 'algorithm=demo'}: DeMo needs its optimizer; pass it to attach")
        self.optimizers = list(optimizers)  # type: ignore[arg-type]
        for opt in self.optimizers:
            exchange = Exchange(self.section.values, self.spec, self.traffic, debug=self.config.debug)
            opt.attach_exchange(exchange, self.section.delay)
        logger.info(
            "lowbit: demo, %s; values %s, delay %d", self.spec.describe(), self.section.values, self.section.delay
        )

    def detach(self) -> None:
        for opt in self.optimizers:
            opt.attach_exchange(None)

    def traffic_logs(self) -> list[TrafficLog]:
        return [self.traffic, self.node_traffic]

    def metrics(self) -> dict[str, float]:
        """The share of the momenta's energy the last step sent, and the steps skipped."""
        out = {"demo/skipped": float(sum(o.skipped_steps for o in self.optimizers))}
        shares = [
            o.exchange.energy for o in self.optimizers if o.exchange is not None and o.exchange.energy is not None
        ]
        if shares:
            out["demo/energy_sent"] = float(torch.stack([s.float() for s in shares]).mean())
        return out

    # ---- checkpoints ------------------------------------------------------------------------
    def algorithm_state_dict(self) -> dict:
        pending = []
        for opt in self.optimizers:
            f = opt.pending
            pending.append(None if f is None else {"payloads": f.payloads().cpu().clone(), "lrs": f.lrs, "wds": f.wds})
        return {
            "format": FORMAT,
            "optimizers": [to_cpu(opt.state_dict()["state"]) for opt in self.optimizers],
            "steps": [[g.get("demo_step", 0) for g in opt.param_groups] for opt in self.optimizers],
            "skipped": [opt.skipped_steps for opt in self.optimizers],
            "pending": pending,
        }

    def load_algorithm_state_dict(self, state: dict) -> None:
        if not state:
            return
        if state.get("format") != FORMAT:
            raise ValueError(f"DeMo state of format {state.get('format')!r}; this version reads {FORMAT}")
        saved = state["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError(f"DeMo state holds {len(saved)} optimizers' momenta, the run has {len(self.optimizers)}")
        for opt, own, steps, skipped, pending in zip(
            self.optimizers, saved, state["steps"], state["skipped"], state["pending"]
        ):
            opt.load_state_dict({**opt.state_dict(), "state": own})
            dtensor_state_(opt)  # sharded: local shards back to DTensors like their parameters
            for grp, n in zip(opt.param_groups, steps):
                grp["demo_step"] = n
            opt.skipped_steps = int(skipped)
            opt.pending = None
            if pending is not None:
                device = next((p.device for g in opt.param_groups for p in g["params"]), torch.device("cpu"))
                payloads = pending["payloads"].to(device)
                opt.pending = Flight(Landed(payloads), list(pending["lrs"]), list(pending["wds"]), gathered=payloads)


def merge_states(states: list[dict]) -> dict:
    """DeMo's state at another number of workers: each momentum the mean over the saved ranks
    (the residuals of what they had not sent yet), the counters and any exchange in flight of
    rank 0 (the gathered payloads are the same on every rank). Should that exchange be skipped,
    a worker puts back what its counterpart of the old layout sent (rank 0's row: the merged
    momenta are a mean anyway)."""
    first = states[0]
    if not first:
        return {}
    merged = [mean_states(per_rank, "DeMo state") for per_rank in zip(*(s["optimizers"] for s in states))]
    return {**first, "optimizers": merged}


ALGORITHM = Algorithm(
    name="demo",
    section=DeMoConfig,
    build=DeMoSync,
    strategy_names={"lowbit_demo": dict(algorithm="demo")},
    merge_states=merge_states,
    check_precision=local_gradients_precision("DeMo's optimizers"),
    summary="DeMo decoupled momentum, top-k DCT coefficients (lowbit_strategy.DeMo)",
    optimizer=DeMo,
    hierarchical=True,
    sharded=True,
)
