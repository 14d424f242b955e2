"""The MLP of :mod:`benchmarks.nodes.sharded`'s ``--model mlp``: a stack of ``layers`` blocks
(``Linear(d, 2d)``, GELU, ``Linear(2d, d)``, a residual), about ``4·d²`` parameters each, fit
by mean-squared error to a fixed random teacher of the same shape. Few operations per
parameter, so its exchange weighs more against its compute than the GPT's: at ``d = 1024``,
three blocks hold 12.6M parameters, the size of the independent measurement the sharded overlap
was asked against (a 3-block MLP, FSDP2 per block and at the root).

It offers what :mod:`benchmarks.nodes.sharded_worker` uses of the GPT: ``blocks`` (each
``fully_shard``-ed), ``_loss((x, y))`` and ``configure_optimizers()`` (the optimizer of
:func:`examples.causal_lm.make_optimizer`, linear warm-up then cosine decay); :func:`datasets`
gives the training and held-out pairs.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
from torch import nn
from torch.utils.data import TensorDataset


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


class MLP(nn.Module):
    """``layers`` residual blocks of width ``d`` (module docstring)."""

    def __init__(self, d: int, layers: int, lr: float, optimizer: str, freeze_step: int, warmup: int = 20,
                 total_steps: int = 2000):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.hparams = SimpleNamespace(lr=lr, optimizer=optimizer, freeze_step=freeze_step, warmup=warmup,
                                       total_steps=total_steps, weight_decay=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> dict:
        from examples.causal_lm import make_optimizer

        hp = self.hparams
        opt = make_optimizer(self.parameters(), hp)

        def schedule(step: int) -> float:  # as examples.causal_lm: linear warm-up, cosine decay to 10 %
            if step < hp.warmup:
                return (step + 1) / hp.warmup
            frac = min(1.0, (step - hp.warmup) / max(1, hp.total_steps - hp.warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule)}}


@torch.no_grad()
def datasets(d: int, samples: int, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """``(training, held-out)`` pairs ``(x, teacher(x))``: ``x`` standard normal, the teacher
    one fixed random block of width ``d`` (the same on every rank: seeded by ``seed``); 90 %
    / 10 % of ``samples``."""
    gen = torch.Generator().manual_seed(seed + 12345)
    x = torch.randn(samples, d, generator=gen)
    w1 = torch.randn(d, 2 * d, generator=gen) / math.sqrt(d)
    w2 = torch.randn(2 * d, d, generator=gen) / math.sqrt(2 * d)
    y = x + nn.functional.gelu(x @ w1) @ w2
    split = int(samples * 0.9)
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])
