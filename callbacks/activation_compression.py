"""ActivationCompression: train with the linear layers' inputs kept as TurboQuant codes.

At ``setup`` the callback replaces the selected ``nn.Linear`` layers of the LightningModule
by :class:`lowbit_strategy.nn.TurboQuantLinear` ("TurboQuant-Adam"'s activation
compression: forward and input gradients exact, the weight gradient from the input's 4-bit
codes); selection as in :func:`lowbit_strategy.nn.compress_activations` (every
``nn.Linear`` but the output head by default; ``include``/``exclude`` patterns over module
names).

Why at ``setup``: Lightning calls ``Callback.setup`` before ``LightningModule.setup`` and
``configure_model``, before the strategy moves the model, wraps it in DDP and calls
``configure_optimizers`` (``Trainer._run``: ``_call_setup_hook`` → ``_call_configure_model``
→ ``strategy.setup``). The swap keeps the Parameter objects and the module order, so DDP,
the optimizer, a lowbit strategy's parameter selection (a ``TurboQuantLinear`` is an
``nn.Linear``) and the ``state_dict`` are what they would be without it: a checkpoint saved
with the callback loads without it and the other way round, and the callback itself keeps
no state. Layers a LightningModule creates in its own ``setup`` or ``configure_model`` do
not exist yet at that point; for those, call ``compress_activations(self)`` at the end of
that hook (the callback warns when ``configure_model`` is overridden). Works with one
device, plain ``ddp`` and every ``lowbit_*`` strategy: it changes what autograd keeps, not
what is communicated.

It logs (global zero, logger ``callbacks.activation_compression``) which layers it
replaced, and, on the first training batch, the bytes that batch's forward pass kept for
backward with compression and without (one :class:`~lowbit_strategy.nn.SavedTensorMeter`
pass, from the training batch start to ``on_before_backward``; ``measure=False`` turns it
off, e.g. when the first step must not hold the uncompressed inputs while it counts them,
see the meter). The result is :attr:`ActivationCompression.report`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import lightning.pytorch as pl
from torch import nn

from lowbit_strategy.nn import SavedTensorMeter, SavedTensorStats, TurboQuantLinear, compress_activations
from lowbit_strategy.nn.linear import check_layer_settings
from lowbit_strategy.roles import check_patterns

logger = logging.getLogger(__name__)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


class ActivationCompression(pl.Callback):
    """``ActivationCompression(include=None, exclude=None, bits=4, block=None, measure=True)``.

    ``include``/``exclude``: fnmatch patterns over module names (``"blocks.*.fc"``), each
    must match a linear layer; ``bits``/``block``: the codes' width and rotation block
    (:class:`~lowbit_strategy.nn.TurboQuantLinear`); ``measure``: count the saved bytes of
    the first training batch. After setup :attr:`swapped` lists the replaced layers.
    """

    def __init__(
        self,
        include: str | Sequence[str] | None = None,
        exclude: str | Sequence[str] | None = None,
        bits: int = 4,
        block: int | None = None,
        measure: bool = True,
    ) -> None:
        check_layer_settings("ActivationCompression", bits, block, 0)  # at construction, not at setup
        self.include = check_patterns("ActivationCompression: include", include)
        self.exclude = check_patterns("ActivationCompression: exclude", exclude)
        self.bits, self.block, self.measure = bits, block, bool(measure)
        self.swapped: list[str] = []
        self.report: SavedTensorStats | None = None
        self._meter: SavedTensorMeter | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        names = compress_activations(pl_module, self.include, self.exclude, bits=self.bits, block=self.block)
        self.swapped.extend(names)
        if not trainer.is_global_zero:
            return
        if names:
            kept = [
                n
                for n, m in pl_module.named_modules()
                if isinstance(m, nn.Linear) and not isinstance(m, TurboQuantLinear)
            ]
            logger.info(
                "ActivationCompression: %d linear layers keep their input for backward as %d-bit codes: %s%s",
                len(names),
                self.bits,
                ", ".join(names),
                f" (left exact: {', '.join(kept)})" if kept else "",
            )
        elif not self.swapped:
            logger.warning("ActivationCompression: no linear layer selected; nothing is compressed")
        if type(pl_module).configure_model is not pl.LightningModule.configure_model:
            logger.warning(
                "ActivationCompression: %s overrides configure_model, which runs after this callback's setup: "
                "layers it creates are not compressed; call lowbit_strategy.nn.compress_activations(self) at its end",
                type(pl_module).__name__,
            )

    # -- the first batch's saved bytes -----------------------------------------------------

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.measure and self.report is None and self._meter is None:
            self._meter = SavedTensorMeter(pl_module).start()

    def _finish(self, trainer) -> None:
        if self._meter is None:
            return
        self.report = r = self._meter.stop()
        self._meter = None
        if trainer.is_global_zero:
            logger.info(
                "ActivationCompression: the first training batch kept %s for backward (%s without compression, "
                "%.2fx); linear inputs %s (%s without, %.1fx less)",
                _mib(r.total_bytes),
                _mib(r.total_bytes_uncompressed),
                r.total_bytes_uncompressed / r.total_bytes if r.total_bytes else 1.0,
                _mib(r.linear_input_bytes),
                _mib(r.linear_input_bytes_uncompressed),
                r.linear_input_ratio,
            )

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self._finish(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._finish(trainer)  # a step without backward (training_step returned None)

    def on_exception(self, trainer, pl_module, exception) -> None:
        if self._meter is not None:  # leave no saved-tensor hooks behind
            self._meter.stop()
            self._meter = None
