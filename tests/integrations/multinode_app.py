"""One node of a 2-node job, as users launch it: plain DDP under ``torchrun --nnodes 2
--node-rank K``, a Lightning ``Trainer(num_nodes=2, devices=2)`` started once per node with
``NODE_RANK=K``, or ``LowBitAccelerator`` under ``accelerate launch --num_machines 2
--machine_rank K``. Lion Cub 1-bit, a few steps; every rank writes what it saw (its topology,
its weights' digest, its bytes across and inside nodes) to ``--out``/rank<R>.json.

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank K --master-addr 127.0.0.1 --master-port P \
        -m tests.integrations.multinode_app --front ddp --out DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import lowbit_strategy
from lowbit_strategy import LowBitConfig
from tests.integrations.restart_app import _batch, _model

STEPS = 4


def _report(args, sync, params) -> None:
    digest = hashlib.sha256(torch.cat([p.detach().reshape(-1) for p in params]).numpy().tobytes()).hexdigest()
    logs = sync.traffic_logs()
    rank = dist.get_rank()
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "topology": sync.topology.describe() if sync.topology is not None else "flat",
        "node": sync.topology.node if sync.topology is not None else None,
        "digest": digest,
        "network_bytes": sum(log.bytes_sent for log in logs),
        "node_bytes": sum(log.node_bytes_sent for log in logs),
        "env": {k: os.environ.get(k) for k in ("LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "LOCAL_RANK")},
    }
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def run_ddp(args) -> None:
    dist.init_process_group("gloo")
    ddp = nn.parallel.DistributedDataParallel(_model())
    opt = lowbit_strategy.Lion(ddp.parameters(), lr=1e-3)
    sync = lowbit_strategy.attach(ddp, [opt], LowBitConfig(algorithm="lion", mode="1bit", bucket_size_mb=0.001))
    for step in range(1, STEPS + 1):
        x, y = _batch(dist.get_rank(), step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    _report(args, sync, ddp.module.parameters())
    dist.barrier()


def run_lightning(args) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            return nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return lowbit_strategy.Lion(self.parameters(), lr=1e-3)

    xs, ys = zip(*(_batch(r, s) for s in range(1, 3) for r in range(4)))
    pl.seed_everything(0, verbose=False)
    model = Net()
    trainer = pl.Trainer(strategy="lowbit_lion_1bit", accelerator="cpu", devices=2, num_nodes=2, max_epochs=2,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False)
    trainer.fit(model, DataLoader(TensorDataset(torch.cat(xs), torch.cat(ys)), batch_size=8))
    _report(args, trainer.strategy.sync, model.parameters())
    dist.barrier()


def run_accelerate(args) -> None:
    from lowbit_strategy.accelerate import LowBitAccelerator

    accelerator = LowBitAccelerator(lowbit=LowBitConfig(algorithm="lion", mode="1bit", bucket_size_mb=0.001))
    model = _model()
    opt = lowbit_strategy.Lion(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    for step in range(1, STEPS + 1):
        x, y = _batch(accelerator.process_index, step)
        opt.zero_grad()
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
    _report(args, accelerator.lowbit_syncs[0], accelerator.unwrap_model(model).parameters())
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--front", choices=("ddp", "lightning", "accelerate"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    {"ddp": run_ddp, "lightning": run_lightning, "accelerate": run_accelerate}[args.front](args)
    # done: leave without interpreter finalization (tests/distributed.py has the same exit, and why)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
