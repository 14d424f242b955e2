"""DivergenceMonitor: how far the ranks' views drift apart, how well the compressed update
agrees with the full-precision one, and how far a frozen variance is from a fresh one.

Works with every optimizer-level algorithm through optional optimizer methods (no
per-algorithm branch here): ``divergence_tensors()``, ``variance_ratios()`` and
``replica_tensors()``.

* ``divergence/<param>``: the maximum over elements of the standard deviation across ranks
  of the optimizer's rank-local tensor (one fp32 allreduce of [x, x²]): Lion Cub's momentum
  (Fig. 6); for 1-bit Adam/LAMB in the compression stage, the local part (1-β1)·g_i of the
  momentum each rank sends (its spread is what the compressed allreduce has to average);
  ``divergence/max`` over all parameters.
* ``variance/<param>`` (1-bit Adam/LAMB, compression stage): the ratio r of frozen to fresh
  variance (1-bit LAMB Algorithm 1 line 17, before clipping), 1 while the frozen variance
  still fits; ``variance/max``. 1-bit LAMB computes it anyway; for ``OneBitAdam`` the
  monitor switches on ``track_variance`` at the start of training (one more buffer).
* ``spread/<kind>/<param>`` (TurboQuant-Adam): ``max |x_r − x_0|`` over elements and ranks
  of tensors that should be identical on every rank, by kind: ``variance`` (Adam's ``v``)
  and, under ``variance="local"`` (the paper's), ``param`` (the weights). Exactly 0 while
  the replicas agree (rank 0's tensors are broadcast, each rank takes ``|x_r − x_0|`` and a
  MAX allreduce combines them: O(N) memory and bytes per rank whatever P, and no rounding
  of a mean or a variance blurs it); growing values show drift before it hurts.
  ``spread/<kind>/max`` over all parameters.
* with ``sign_agreement=True``: ``sign/match`` and ``sign/flip``, the fractions of elements
  whose synchronized direction equals / reverses the full-precision direction (Fig. 4);
  costs one extra fp32 allreduce of the update vector on monitored steps.

Sign rates are running means over the monitored steps of one run (torchmetrics
``MeanMetric``), created in :meth:`setup`, i.e. in each training process: a metric built in
``__init__`` would travel to ``*_spawn`` workers inside the pickled Trainer, and
``torch.multiprocessing`` moves pickled tensors into shared memory, so every rank would add
into the same two scalars (a race that once pushed ``sign/match`` above 1).
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torchmetrics.aggregation import MeanMetric

from lowbit_strategy.collectives import full_allreduce
from lowbit_strategy.collectives.group import all_reduce_max, broadcast
from lowbit_strategy.roles import param_names
from lowbit_strategy.validation import check_int


class DivergenceMonitor(pl.Callback):
    def __init__(self, every: int = 50, sign_agreement: bool = False):
        check_int("DivergenceMonitor", "every", every, 1)
        self.every = every
        self.sign_agreement = sign_agreement
        self.match: MeanMetric | None = None
        self.flip: MeanMetric | None = None
        self.last: dict[str, float] = {}

    def setup(self, trainer, pl_module, stage: str) -> None:
        # the rates are global (identical on every rank): no hidden cross-rank sync in compute()
        self.match, self.flip = MeanMetric(sync_on_compute=False), MeanMetric(sync_on_compute=False)

    @staticmethod
    def _auditable(trainer):
        """Optimizers that can audit a step against the full-precision direction (Lion Cub)."""
        return [
            o
            for o in trainer.optimizers
            if getattr(o, "communicator", None) is not None and hasattr(o, "audit_next_step")
        ]

    @staticmethod
    def _monitored(trainer):
        return [
            o
            for o in trainer.optimizers
            if getattr(o, "communicator", None) is not None and hasattr(o, "divergence_tensors")
        ]

    def on_train_start(self, trainer, pl_module) -> None:
        for opt in self._monitored(trainer):
            if hasattr(opt, "track_variance"):
                opt.track_variance = True

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.sign_agreement and (trainer.global_step + 1) % self.every == 0:
            for opt in self._auditable(trainer):
                opt.audit_next_step = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 0 or trainer.global_step % self.every:
            return
        names = param_names(pl_module)
        values: dict[str, float] = {}
        for opt in self._monitored(trainer):
            values.update(self._spread(opt, names))
            values.update(self._ratios(opt, names))
            values.update(self._replicas(opt, names))
        for opt in self._auditable(trainer):
            audit = opt.communicator.last_audit
            match, flip = self.match, self.flip  # both made in setup()
            if self.sign_agreement and audit is not None and match is not None and flip is not None:
                match.update(audit["sign_match"])
                flip.update(audit["sign_flip"])
                values["sign/match"] = float(match.compute())
                values["sign/flip"] = float(flip.compute())
                opt.communicator.last_audit = None
        for name, value in values.items():
            pl_module.log(name, value, on_step=True, on_epoch=False)
        self.last = values

    def _spread(self, opt, names: dict[int, str]) -> dict[str, float]:
        pairs = opt.divergence_tensors()  # the same parameters on every rank
        if not pairs:
            return {}
        parts = [t.detach().float().reshape(-1) for _, t in pairs]
        flat = torch.cat(parts)
        both = full_allreduce(torch.cat([flat, flat * flat]), opt.communicator.group, traffic=opt.communicator.traffic)
        world = opt.communicator.world_size
        mean, mean_sq = (both / world).split(flat.numel())
        std = (mean_sq - mean * mean).clamp_min(0).sqrt()
        out = {
            f"divergence/{names.get(id(p), 'param')}": float(s.max())
            for (p, _), s in zip(pairs, std.split([t.numel() for t in parts]))
        }
        out["divergence/max"] = max(out.values())
        return out

    @staticmethod
    def _replicas(opt, names: dict[int, str]) -> dict[str, float]:
        kinds = opt.replica_tensors() if hasattr(opt, "replica_tensors") else {}
        comm = opt.communicator
        out: dict[str, float] = {}
        for kind, pairs in kinds.items():  # the same kinds and parameters on every rank
            if not pairs:
                continue
            parts = [t.detach().float().reshape(-1) for _, t in pairs]
            flat = torch.cat(parts)
            first = flat.clone()
            broadcast(first, 0, comm.group, f"divergence.{kind}.broadcast", comm.traffic)
            gap = (flat - first).abs_()  # max over ranks of |x_r - x_0|, per element
            all_reduce_max(gap, comm.group, f"divergence.{kind}.max", comm.traffic)
            values = {
                f"spread/{kind}/{names.get(id(p), 'param')}": float(s.max())
                for (p, _), s in zip(pairs, gap.split([t.numel() for t in parts]))
            }
            values[f"spread/{kind}/max"] = max(values.values())
            out.update(values)
        return out

    @staticmethod
    def _ratios(opt, names: dict[int, str]) -> dict[str, float]:
        pairs = opt.variance_ratios() if hasattr(opt, "variance_ratios") else []
        out = {f"variance/{names.get(id(p), 'param')}": float(r) for p, r in pairs}
        if out:
            out["variance/max"] = max(out.values())
        return out
