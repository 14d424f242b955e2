"""DivergenceMonitor: how far the ranks' momenta drift apart, and how well the compressed
update agrees with the full-precision one.

* ``divergence/<param>``: the maximum over elements of the standard deviation across ranks
  of the momentum (Lion Cub Fig. 6), from one fp32 allreduce of [m, m²];
  ``divergence/max`` over all parameters.
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

from lowbit_strategy import Lion
from lowbit_strategy.collectives import full_allreduce
from lowbit_strategy.selection import param_names


class DivergenceMonitor(pl.Callback):
    def __init__(self, every: int = 50, sign_agreement: bool = False):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"DivergenceMonitor: every must be an int >= 1, got {every!r}")
        self.every = every
        self.sign_agreement = sign_agreement
        self.match: MeanMetric | None = None
        self.flip: MeanMetric | None = None
        self.last: dict[str, float] = {}

    def setup(self, trainer, pl_module, stage: str) -> None:
        # the rates are global (identical on every rank): no hidden cross-rank sync in compute()
        self.match, self.flip = MeanMetric(sync_on_compute=False), MeanMetric(sync_on_compute=False)

    def _lions(self, trainer):
        return [o for o in trainer.optimizers if isinstance(o, Lion) and o.communicator is not None]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.sign_agreement and (trainer.global_step + 1) % self.every == 0:
            for opt in self._lions(trainer):
                opt.audit_next_step = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 0 or trainer.global_step % self.every:
            return
        names = param_names(pl_module)
        values: dict[str, float] = {}
        for opt in self._lions(trainer):
            values.update(self._momentum_std(opt, names))
            audit = opt.communicator.last_audit
            if self.sign_agreement and audit is not None and self.match is not None:
                self.match.update(audit["sign_match"])
                self.flip.update(audit["sign_flip"])
                values["sign/match"] = float(self.match.compute())
                values["sign/flip"] = float(self.flip.compute())
                opt.communicator.last_audit = None
        for name, value in values.items():
            pl_module.log(name, value, on_step=True, on_epoch=False)
        self.last = values

    def _momentum_std(self, opt: Lion, names: dict[int, str]) -> dict[str, float]:
        params = [p for grp in opt.param_groups for p in grp["params"] if "exp_avg" in opt.state[p]]
        if not params:
            return {}
        moms = [opt.state[p]["exp_avg"].float().reshape(-1) for p in params]
        flat = torch.cat(moms)
        both = full_allreduce(torch.cat([flat, flat * flat]), opt.communicator.group,
                              traffic=opt.communicator.traffic)
        world = opt.communicator.world_size
        mean, mean_sq = (both / world).split(flat.numel())
        std = (mean_sq - mean * mean).clamp_min(0).sqrt()
        out = {f"divergence/{names.get(id(p), 'param')}": float(s.max())
               for p, s in zip(params, std.split([m.numel() for m in moms]))}
        out["divergence/max"] = max(out.values())
        return out
