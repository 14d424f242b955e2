"""Fit ``tests.lightning_app``'s TinyLM with ``ActivationCompression`` under a strategy, save
a checkpoint, resume from it *without* the callback; the global-zero process writes a JSON
summary. Run in a fresh interpreter (``python -m tests.callbacks.activation_app``): the
``popen`` launchers re-execute the command line."""
from __future__ import annotations

import argparse
import json
import os
import sys

import lightning.pytorch as pl
import torch
from torch import nn

import lowbit_strategy  # noqa: F401  (registers the lowbit_* names)
from callbacks import ActivationCompression
from lowbit_strategy.nn import TurboQuantLinear
from tests.lightning_app import VOCAB, TinyLM, loader, trainer


class OptimizerSees(pl.Callback):
    """Whether the optimizer holds exactly the module's parameters, and the types of the
    linear layers the strategy trains (checked once training starts)."""

    def on_train_start(self, tr, pl_module):
        ids = {id(p) for g in tr.optimizers[0].param_groups for p in g["params"]}
        self.same_params = ids == {id(p) for p in pl_module.parameters()}
        self.types = {n: type(m).__name__ for n, m in pl_module.named_modules() if isinstance(m, nn.Linear)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="lowbit_lion")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--optimizer", default="lion")
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    pl.seed_everything(0, verbose=False)
    model = TinyLM(optimizer=args.optimizer)
    data = loader()
    x, y = data.dataset.tensors
    first = float(nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)))
    ac, seen = ActivationCompression(), OptimizerSees()
    tr = trainer(args.strategy, args.devices, 2, callbacks=[ac, seen])
    tr.fit(model, data)
    ckpt = os.path.join(args.workdir, "with_callback.ckpt")
    tr.save_checkpoint(ckpt)
    after = float(nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)))
    # resume without the callback: plain layers, the same keys, the optimizer state restored
    pl.seed_everything(0, verbose=False)
    plain = TinyLM(optimizer=args.optimizer)
    tr2 = trainer(args.strategy, args.devices, 3)
    tr2.fit(plain, data, ckpt_path=ckpt)
    result = {
        "is_global_zero": tr.is_global_zero, "world_size": tr.world_size, "swapped": ac.swapped,
        "same_params": seen.same_params, "types": seen.types,
        "report": None,
        "first_loss": first, "loss_after": after, "resumed_steps": tr2.global_step, "steps": tr.global_step,
        "resumed_plain": not any(isinstance(m, TurboQuantLinear) for m in plain.modules()),
        "resumed_finite": all(bool(torch.isfinite(v).all()) for v in plain.state_dict().values()),
    }
    if ac.report is not None:
        r = ac.report
        result["report"] = {"total": r.total_bytes, "total_uncompressed": r.total_bytes_uncompressed,
                            "linear": r.linear_input_bytes, "linear_uncompressed": r.linear_input_bytes_uncompressed,
                            "compressed_inputs": r.compressed_inputs}
    if tr.is_global_zero:
        with open(args.out, "w") as fh:
            json.dump(result, fh)
    sys.exit(0)


if __name__ == "__main__":
    main()
