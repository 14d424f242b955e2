"""CommStats: bytes on the wire per optimizer step, ratio against fp32, comm seconds.

Reads the traffic the strategy's communicators recorded (every collective records the
bytes this rank sent, :mod:`lowbit_strategy.collectives.wire`) and compares it with what
DDP's fp32 ring allreduce of every trainable gradient would send. Shown in the progress
bar (``comm_MB``, ``comm_x``, and ``comm_x_avg``, the run's average) and logged
(``comm/bytes_per_step``, ``comm/ratio_vs_fp32``, ``comm/seconds_per_step``, and the averages
``comm/bytes_per_step_avg``, ``comm/ratio_vs_fp32_avg``: what an algorithm that sends every H
steps, DiLoCo, costs per step amortized). The algorithm's own figures
(:meth:`~lowbit_strategy.algorithms.base.Sync.metrics`: DiLoCo's ``diloco/rounds``, its
pseudo-gradient norm) are logged beside them.

Read the seconds with care: they are launch-to-completion times of the transfers, which
(BitDP's, and Lion Cub's with ``overlap`` on, the default) run asynchronously, overlapping
each other and the backward pass, so they are not a share of the step; only Lion Cub with
``overlap=False`` blocks in ``step()`` for them. On CUDA the host cannot time them (a
collective returns once queued): ``comm/seconds_per_step`` is then not logged and
:attr:`total_seconds` is None, never a wrong 0. :attr:`bytes_per_step` averages over every
step, warm-up iterations (sent at full precision) included. Reads the logs' running totals:
O(1) per step however long the run.
"""

from __future__ import annotations

import lightning.pytorch as pl

from lowbit_strategy.collectives import wire


class CommStats(pl.Callback):
    """Per-step communication telemetry of a :class:`~lowbit_strategy.LowBitStrategy` run."""

    def __init__(self, prog_bar: bool = True):
        self.prog_bar = prog_bar
        self.total_bytes_sent = 0
        #: summed communication seconds, or None once some were not measurable (CUDA)
        self.total_seconds: float | None = 0.0
        self.steps = 0
        self.fp32_bytes_per_step = 0
        self._seen: dict[int, tuple[int, float | None]] = {}
        self._last_step = -1

    def on_train_start(self, trainer, pl_module) -> None:
        numel = sum(p.numel() for p in pl_module.parameters() if p.requires_grad)
        self.fp32_bytes_per_step = wire.allreduce_bytes(4 * numel, trainer.world_size)
        self._seen = {id(lg): (lg.bytes_sent, lg.seconds) for lg in self._logs(trainer)}

    @staticmethod
    def _logs(trainer) -> list[wire.TrafficLog]:
        getter = getattr(trainer.strategy, "traffic_logs", None)
        return getter() if getter is not None else []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self._last_step:
            return  # gradient accumulation: no optimizer step in this batch
        self._last_step = trainer.global_step
        sent, seconds = 0, 0.0
        timed = True
        for lg in self._logs(trainer):  # deltas of the logs' running totals since the last step
            now_sent, now_seconds = lg.bytes_sent, lg.seconds
            before_sent, before_seconds = self._seen.get(id(lg), (0, 0.0))
            self._seen[id(lg)] = (now_sent, now_seconds)
            sent += now_sent - before_sent
            if now_seconds is None or before_seconds is None:
                timed = False
            else:
                seconds += now_seconds - before_seconds
        self.total_bytes_sent += sent
        self.total_seconds = self.total_seconds + seconds if timed and self.total_seconds is not None else None
        self.steps += 1
        # one process: nothing to send either way, so 1x (not 0x) against fp32
        ratio = self.fp32_bytes_per_step / sent if sent else (1.0 if self.fp32_bytes_per_step == 0 else 0.0)
        pl_module.log("comm_MB", sent / 2**20, prog_bar=self.prog_bar, on_step=True, on_epoch=False)
        pl_module.log("comm_x", ratio, prog_bar=self.prog_bar, on_step=True, on_epoch=False)
        pl_module.log("comm/bytes_per_step", float(sent), on_step=True, on_epoch=False)
        pl_module.log("comm/ratio_vs_fp32", ratio, on_step=True, on_epoch=False)
        if timed:  # (CUDA: unavailable, not logged as a wrong 0)
            pl_module.log("comm/seconds_per_step", seconds, on_step=True, on_epoch=False)
        # the run's average (what an algorithm that sends every H steps costs per step, amortized)
        avg = self.bytes_per_step
        avg_ratio = self.fp32_bytes_per_step / avg if avg else (1.0 if self.fp32_bytes_per_step == 0 else 0.0)
        pl_module.log("comm/bytes_per_step_avg", float(avg), on_step=True, on_epoch=False)
        pl_module.log("comm/ratio_vs_fp32_avg", avg_ratio, on_step=True, on_epoch=False)
        pl_module.log("comm_x_avg", avg_ratio, prog_bar=self.prog_bar, on_step=True, on_epoch=False)
        metrics = getattr(getattr(trainer.strategy, "sync", None), "metrics", None)
        for name, value in (metrics() if callable(metrics) else {}).items():  # the algorithm's own (rounds, ...)
            pl_module.log(name, value, prog_bar=self.prog_bar and name.endswith("rounds"), on_step=True, on_epoch=False)

    @property
    def bytes_per_step(self) -> float:
        return self.total_bytes_sent / self.steps if self.steps else 0.0
