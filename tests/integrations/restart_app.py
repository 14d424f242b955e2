"""A training run that ``torchrun --max-restarts`` restarts: plain DDP, or a Lightning
``Trainer``, with a checkpoint every few steps and every rank's low-bit state beside it.

    torchrun --nproc-per-node 2 --max-restarts 1 -m tests.integrations.restart_app \
        --front ddp --dir CKPT --steps 10 --kill-at 5 --out result.json

``--kill-at K``: on the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0), rank 1 kills itself
(SIGKILL) after step K; torchrun then restarts every rank, which resume from the last
checkpoint. Rank 0 writes the final weights (as a list of floats) and the losses to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
from torch import nn

import lowbit_strategy
from benchmarks.harness.leave import leave
from lowbit_strategy import LowBitConfig


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=gen)
    return x, (x[:, :4].sum(dim=1) > 0).long() + 2 * (x[:, 4:8].sum(dim=1) > 0).long()


def _die_if_asked(args, step: int, rank: int) -> None:
    if step == args.kill_at and rank == 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        os.kill(os.getpid(), signal.SIGKILL)


def _optimizer(name: str, params, lr: float):
    if name == "lion":
        return lowbit_strategy.Lion(params, lr=lr)
    return lowbit_strategy.OneBitAdam(params, lr=lr, freeze_step=3)


def run_ddp(args) -> dict:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = _optimizer(args.optimizer, ddp.parameters(), args.lr)
    algorithm = "lion" if args.optimizer == "lion" else "onebit_adam"
    sync = lowbit_strategy.attach(ddp, [opt], LowBitConfig(algorithm=algorithm, bucket_size_mb=0.0005))
    latest, start, losses = os.path.join(args.dir, "latest.pt"), 1, []
    if os.path.exists(latest):  # a restart: resume from the last checkpoint
        ckpt = torch.load(latest, weights_only=True)
        ddp.module.load_state_dict(ckpt["weights"])
        opt.load_state_dict(ckpt["optimizer"])
        lowbit_strategy.load_rank_states(sync, ckpt["lowbit"], os.path.join(args.dir, f"step{ckpt['step']}"))
        start, losses = ckpt["step"] + 1, list(ckpt["losses"])
    for step in range(start, args.steps + 1):
        x, y = _batch(rank, step)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if step % args.save_every == 0:
            entry = lowbit_strategy.save_rank_states(sync, directory=os.path.join(args.dir, f"step{step}"))
            if rank == 0:  # written whole, then renamed: a kill never leaves half a checkpoint
                state = {"weights": ddp.module.state_dict(), "optimizer": opt.state_dict(), "lowbit": entry,
                         "step": step, "losses": losses}
                torch.save(state, latest + ".tmp")
                os.replace(latest + ".tmp", latest)
            dist.barrier()
        _die_if_asked(args, step, rank)
    weights = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    # the group is destroyed in main(), once this frame (DDP and its reducer) is gone
    return {"world_size": world, "weights": weights.tolist(), "losses": losses}


def run_lightning(args) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            loss = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            return lowbit_strategy.Lion(self.parameters(), lr=1e-3)

    class Killer(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            _die_if_asked(args, trainer.global_step, trainer.global_rank)

    xs, ys = zip(*(_batch(r, s) for s in range(1, 3) for r in range(2)))
    data = TensorDataset(torch.cat(xs), torch.cat(ys))
    pl.seed_everything(0, verbose=False)
    model = Net()
    keep = ModelCheckpoint(dirpath=args.dir, every_n_epochs=1, save_last=True, save_top_k=-1)
    trainer = pl.Trainer(strategy="lowbit_lion", accelerator="cpu", devices=2, max_epochs=args.steps,
                         callbacks=[keep, Killer()], logger=False, enable_progress_bar=False,
                         enable_model_summary=False)
    last = os.path.join(args.dir, "last.ckpt")
    trainer.fit(model, DataLoader(data, batch_size=8), ckpt_path=last if os.path.exists(last) else None)
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"world_size": trainer.world_size, "weights": weights.tolist(), "losses": model.losses,
            "rank": trainer.global_rank}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--front", choices=("ddp", "lightning"), default="ddp")
    parser.add_argument("--optimizer", choices=("lion", "onebit_adam"), default="lion")
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = run_ddp(args) if args.front == "ddp" else run_lightning(args)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.out, "w") as f:
            json.dump({**result, "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}, f)
    # the group destroyed only now that the DDP model is gone, then out without interpreter
    # finalization: benchmarks/harness/leave.py says why for both
    leave(0)

if __name__ == "__main__":
    main()
