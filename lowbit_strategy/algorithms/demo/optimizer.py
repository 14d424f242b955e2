"""DeMo, the optimizer ("DeMo: Decoupled Momentum Optimization", Peng, Quesnelle, Kingma,
arXiv:2411.19870, Algorithm 1), with the argument names of the class published with the paper,
so a DeMo user changes one import.

Per parameter and step, on every worker (its own gradient g; ``η`` the group's lr):

    δ ← β·δ + η·g                              (β = compression_decay)
    q ← top-k coefficients of DCT(δ) per chunk  (codecs.topk, codecs.dct)
    δ ← δ − IDCT(q)                            (what was sent leaves the momentum)
    Q ← per coefficient, the mean of the q's the workers sent
    p ← p·(1 − η·λ) − η·sign(IDCT(Q))          (λ = weight_decay, decoupled)

The weight decay is applied with the update (the published class applies it first; the
product is the same), so a step every worker skips changes no weight anywhere.

Without a communicator (single process) the worker is alone: it sends to itself, with fp32
values. The algorithm ``demo`` attaches an :class:`~.exchange.Exchange` over the workers,
with the section's ``values`` and ``delay``:

* ``delay = 0``: the update is applied in the same ``step()``;
* ``delay = 1``: ``step()`` first applies the previous step's update (its exchange ran during
  this step's forward and backward), then launches its own.

**Non-finite gradients.** A worker whose gradient holds NaN/Inf leaves its momenta as they were
and flags its payload; when any payload is flagged, no worker applies that update (nor its
weight decay), each other worker puts back into δ what it had sent, a warning says so, and
:attr:`DeMo.skipped_steps` counts it. So replicas stay identical and no NaN reaches a weight.

Parameters without a gradient count as a zero gradient (every worker sends the same layout;
a frozen parameter belongs outside the optimizer, as with any optimizer).
``group["lr"]`` is read at every step (schedulers work); DTensor parameters (FSDP2) step on
their local shards, whose chunks tile the shard.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch
from torch.optim import Optimizer

from lowbit_strategy.algorithms.demo.exchange import Exchange, Flight
from lowbit_strategy.layout import local_step
from lowbit_strategy.validation import check_int, check_number

logger = logging.getLogger(__name__)

__all__ = ["DeMo"]


class DeMo(Optimizer):
    """Decoupled momentum: sign-SGD on the workers' mean top-k DCT components of momentum.

    Args:
        params: parameters or parameter groups.
        lr: learning rate η (a sign step moves every weight by η: sign-SGD ranges, like Lion's).
        compression_decay: β, the momentum's decay, in [0, 1).
        compression_topk: coefficients kept per chunk (≥ 1; clamped to the chunk's size).
        compression_chunk: the chunk target per dimension (≥ 1; each dimension's chunk is its
            largest divisor not above it).
        weight_decay: decoupled weight decay λ.
    """

    #: the algorithm that drives this optimizer (another algorithm refuses it at attach)
    lowbit_algorithm = "demo"

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        compression_decay: float = 0.999,
        compression_topk: int = 32,
        compression_chunk: int = 64,
        weight_decay: float = 0.0,
    ):
        check_number("DeMo", "lr", lr, 0.0)
        self.compression_decay = check_number("DeMo", "compression_decay", compression_decay, 0.0, 1.0)
        self.compression_topk = check_int("DeMo", "compression_topk", compression_topk, 1)
        self.compression_chunk = check_int("DeMo", "compression_chunk", compression_chunk, 1)
        check_number("DeMo", "weight_decay", weight_decay, 0.0)
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.exchange: Exchange | None = None
        self.delay = 0
        self.skipped_steps = 0
        #: an exchange launched by the last step, applied by the next (``delay = 1``)
        self.pending: Flight | None = None
        self._local = Exchange("fp32")

    def attach_exchange(self, exchange: Exchange | None, delay: int = 0) -> None:
        """Make this optimizer distributed DeMo over ``exchange`` (None: single-process again)."""
        self.exchange, self.delay = exchange, delay if exchange is not None else 0
        if exchange is None:
            self.pending = None

    def _params(self) -> list[tuple[torch.Tensor, dict]]:
        # every parameter, with or without a gradient (the payload's layout is the same on every
        # worker); not filtered by requires_grad: under local_step a DTensor's local tensor has none
        return [(p, grp) for grp in self.param_groups for p in grp["params"]]

    def delta(self, p: torch.Tensor) -> torch.Tensor:
        """The momentum δ of ``p`` (zeros on first use)."""
        state = self.state[p]
        if "delta" not in state:
            state["delta"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        return state["delta"]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with local_step(self):  # DTensor parameters (FSDP2): their local shards
            self._step()
        return loss

    def _step(self) -> None:
        exchange = self.exchange if self.exchange is not None else self._local
        pairs = self._params()
        params = [p for p, _ in pairs]
        # the codec, built once from the (local) shapes: before a restored flight lands, and for start()
        exchange.codec_for(params, self.compression_chunk, self.compression_topk)
        if self.pending is not None:  # delay = 1: the previous step's update, exchanged meanwhile
            flight, self.pending = self.pending, None
            self._apply(exchange, flight, params)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        # this worker's verdict stays on the device: it travels in the payload, and comes back
        # with everyone's in the one host read of the landing
        # (a sum is non-finite when any element is: one pass instead of isfinite's three)
        finite = torch.isfinite(torch.stack([g.sum() for g in grads])).all() if grads else torch.tensor(True)
        deltas = [self.delta(p) for p in params]
        beta = self.compression_decay
        lrs = [float(grp["lr"]) for _, grp in pairs]
        wds = [float(grp["weight_decay"]) for _, grp in pairs]
        momenta = [d * beta + g.to(d.dtype) * lr for d, g, lr in zip(deltas, grads, lrs)]
        flight = exchange.start(momenta, ~finite, lrs, wds)
        for d, m, s in zip(deltas, momenta, flight.sent or ()):
            # a non-finite gradient leaves the momentum as it was
            d.copy_(torch.where(finite, m.sub_(s), d))
        for grp in self.param_groups:  # steps taken (launched), in the groups: checkpoints carry it
            grp["demo_step"] = grp.get("demo_step", 0) + 1
        if exchange is self._local or self.delay == 0:
            self._apply(exchange, flight, params)
        else:
            self.pending = flight

    def _apply(self, exchange: Exchange, flight: Flight, params: list[torch.Tensor]) -> None:
        update, own_bad = exchange.land(flight, params)
        if update is None:
            self.skipped_steps += 1
            logger.warning(
                "lowbit: DeMo step skipped on every worker: a worker's gradient is non-finite (skipped so far: %d)",
                self.skipped_steps,
            )
            if not own_bad:  # what this worker sent goes back into its momentum
                for p, s in zip(params, exchange.own(flight, params)):
                    self.delta(p).add_(s)
            return
        for p, u, lr, wd in zip(params, update, flight.lrs, flight.wds):
            if wd:
                p.mul_(1 - lr * wd)
            p.add_(torch.sign(u).to(p.dtype), alpha=-lr)
        exchange.verify(params)
