"""One node of a 2-node x 2-device Lightning job under ``LowBitFSDPStrategy`` (FSDP2 inside
each node, the low-bit exchange across nodes), started once per node with ``NODE_RANK=K``, as
tests/integrations/test_multinode.py starts its Lightning node; Lightning's launcher starts
the node's second process. Every rank runs the same fits and writes what it checked to
``--out``/rank<R>.json.

    NODE_RANK=K MASTER_ADDR=127.0.0.1 MASTER_PORT=P python -m tests.integrations.lightning_sharded_app \
        --check lion|adam --out DIR

The LightningModule shards nothing itself (``SelfSharded`` does, in ``configure_model``);
its ``training_step`` calls ``self.model`` (not ``self``), so FSDP's root must be the
strategy's wrapper. Data: Lightning's training sampler is always a shuffling DistributedSampler
(seed ``PL_GLOBAL_SEED`` = 0, ``set_epoch`` every epoch): the plain ``attach_sharded`` loop
builds the same one, so it sees the same batches.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lowbit_strategy
from callbacks import CommStats
from lowbit_strategy import LowBitConfig

VOCAB, SEQ, DIM, BATCH, NODES, DEVICES = 16, 6, 16, 4, 2, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, h):
        return h + self.ff(self.norm(h))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, DIM), Block(), Block(), nn.Linear(DIM, VOCAB))


def _loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def _optimizer(name: str, params):
    if name == "lion":
        return lowbit_strategy.Lion(params, lr=1e-2, weight_decay=0.01)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2)
    if name == "lamb":
        return lowbit_strategy.OneBitLamb(params, lr=1e-2, freeze_step=3)
    if name == "turboquant":
        return lowbit_strategy.TurboQuantAdamW(params, lr=1e-2, warmup_steps=3)
    if name == "demo":
        return lowbit_strategy.DeMo(params, lr=1e-2, compression_topk=4, weight_decay=0.01)
    freeze = 100 if name == "adam_warmup" else 3  # 4 steps an epoch: epoch 2 compresses
    return lowbit_strategy.OneBitAdam(params, lr=1e-2, freeze_step=freeze)


class Net(pl.LightningModule):
    """Does nothing about sharding; its step calls ``self.model``."""

    def __init__(self, optimizer: str):
        super().__init__()
        self.optimizer_name = optimizer
        self.model = _model()

    def training_step(self, batch, batch_idx):
        loss = _loss(self.model, batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", _loss(self.model, batch), sync_dist=True)

    def configure_optimizers(self):
        return _optimizer(self.optimizer_name, self.parameters())


class SelfSharded(Net):
    """Shards its blocks and its model itself, over the strategy's mesh."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        for block in (self.model[1], self.model[2]):
            fully_shard(block, mesh=self.device_mesh["shard"])
        fully_shard(self.model, mesh=self.device_mesh["shard"])


def _data() -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (64, SEQ), generator=gen)
    return TensorDataset(x, (x + 1) % VOCAB)


def _strategy(name: str, **overrides):
    """The registered ``name``; with LowBitConfig ``overrides`` the strategy it names, rebuilt."""
    from lightning.pytorch.strategies import StrategyRegistry

    if not overrides:
        return name
    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], **overrides})


def _fit(strategy, optimizer: str, epochs: int = 2, module=Net, ckpt=None, **kw):
    pl.seed_everything(0, verbose=False)
    model = module(optimizer)
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=DEVICES, num_nodes=NODES, max_epochs=epochs, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        **{"enable_checkpointing": False, **kw},
    )
    trainer.fit(model, DataLoader(_data(), batch_size=BATCH, shuffle=False), ckpt_path=ckpt)
    return trainer, model


def _full(model: nn.Module) -> torch.Tensor:
    """Every parameter, gathered whole (a collective over each node), flattened."""
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).reshape(-1)
                      for p in model.parameters()])


def _same_everywhere(flat: torch.Tensor) -> bool:
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], e) for e in every)


def _plain(optimizer: str, cfg: LowBitConfig, epochs: int = 2) -> torch.Tensor:
    """The same model, data and steps through plain ``attach_sharded`` (no Lightning)."""
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = lowbit_strategy.node_mesh("cpu", cfg.replace(ranks_per_node=DEVICES))
    for unit in (model[1], model[2], model[3], model):  # the strategy's units: both blocks, the head, the root
        fully_shard(unit, mesh=mesh["shard"])
    opt = _optimizer(optimizer, model.parameters())
    lowbit_strategy.attach_sharded(model, [opt], cfg, mesh=mesh)
    sampler = DistributedSampler(_data(), num_replicas=dist.get_world_size(), rank=dist.get_rank(), shuffle=True, seed=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in DataLoader(_data(), batch_size=BATCH, sampler=sampler):
            opt.zero_grad()
            _loss(model, batch).backward()
            opt.step()
    return _full(model)


def _bytes_per_step(trainer) -> list[float]:
    """Bytes across nodes per optimizer step: from the strategy's traffic logs, and as the
    ``CommStats`` callback logged them (its progress-bar figure) for the last step."""
    total = sum(log.bytes_sent for log in trainer.strategy.traffic_logs())
    return [total / trainer.global_step, float(trainer.callback_metrics["comm/bytes_per_step"])]


def _error(strategy, optimizer: str) -> str:
    try:
        _fit(strategy, optimizer, epochs=1)
    except lowbit_strategy.LowBitSetupError as e:
        return str(e)
    return ""


def _resume(strategy, optimizer: str, straight: torch.Tensor, workdir: Path) -> dict:
    """1 epoch + checkpoint (a DCP directory, the rank-local state inside), then epoch 2 from
    it: the same weights as 2 epochs straight?"""
    from lightning.pytorch.callbacks import ModelCheckpoint

    _fit(strategy(), optimizer, epochs=1, enable_checkpointing=True,
         callbacks=[ModelCheckpoint(dirpath=workdir, filename="epoch{epoch}", save_top_k=-1)])
    ckpt = workdir / sorted(os.listdir(workdir))[0]
    _, resumed = _fit(strategy(), optimizer, ckpt=str(ckpt))
    return {"checkpoint": sorted(p.name for p in ckpt.iterdir()),
            "rank_files": sorted(p.name for p in (ckpt / "lowbit").iterdir()),
            "resume_bit_exact": torch.equal(straight, _full(resumed))}


def check_lion(workdir: Path) -> dict:
    name, cfg = "lowbit_lion_fsdp", LowBitConfig(algorithm="lion", mode="1bit")
    trainer, model = _fit(_strategy(name, mode="1bit"), "lion")
    straight = _full(model)
    units = sorted({type(m).__name__ for m in trainer.strategy.model.modules() if hasattr(m, "set_all_reduce_hook")})
    out = {"units": units, "finite": bool(torch.isfinite(straight).all()), "identical": _same_everywhere(straight),
           "bytes": sum(log.bytes_sent for log in trainer.strategy.traffic_logs()),
           "loss": float(trainer.callback_metrics["train_loss"]), "global_step": trainer.global_step,
           "overlap": trainer.strategy.sync.overlap}
    # clipping changes gradients after backward: the exchange moves to optimizer.step()
    clipped, _ = _fit(_strategy(name, mode="1bit"), "lion", epochs=1, gradient_clip_val=0.5)
    out["overlap_when_clipping"] = clipped.strategy.sync.overlap
    out["equals_plain"] = torch.equal(straight, _plain("lion", cfg))
    # validate after fit: the same trainer sets the sharded module up again (its root is kept)
    metrics = trainer.validate(model, DataLoader(_data(), batch_size=BATCH), verbose=False)[0]
    out["val_loss_finite"] = bool(torch.isfinite(torch.tensor(metrics["val_loss"])))
    out["unchanged_by_validate"] = torch.equal(straight, _full(model))
    out.update(_resume(lambda: _strategy(name, mode="1bit"), "lion", straight, workdir))
    # a module that shards itself in configure_model: left as it is, the same result
    _, own = _fit(_strategy(name, mode="1bit"), "lion", module=SelfSharded)
    out["self_sharded_equal"] = torch.equal(straight, _full(own))
    # the bare registered name (mode 'auto') trains too
    trainer, model = _fit(name, "lion")
    flat = _full(model)
    out["auto"] = {"finite": bool(torch.isfinite(flat).all()), "identical": _same_everywhere(flat),
                   "steps": trainer.global_step}
    return out


def check_adam(workdir: Path) -> dict:
    trainer, model = _fit("lowbit_adam_fsdp", "onebit_adam")
    flat = _full(model)
    out = {"finite": bool(torch.isfinite(flat).all()), "identical": _same_everywhere(flat),
           "global_step": trainer.global_step,
           "equals_plain": torch.equal(flat, _plain("onebit_adam", LowBitConfig(algorithm="onebit_adam")))}
    # the checkpoint after epoch 1 is one step into compression: the error buffers are in it
    out["resume_bit_exact"] = _resume(lambda: "lowbit_adam_fsdp", "onebit_adam", flat, workdir)["resume_bit_exact"]
    # accumulation: 1-bit Adam's warm-up averages in FSDP's hook, once per synced backward
    one, _ = _fit("lowbit_adam_fsdp", "adam_warmup", callbacks=[CommStats()])
    two, _ = _fit("lowbit_adam_fsdp", "adam_warmup", accumulate_grad_batches=2, callbacks=[CommStats()])
    out["accumulation"] = {"steps": [one.global_step, two.global_step],
                           "bytes_per_step": [_bytes_per_step(one), _bytes_per_step(two)]}
    # BitDP (gradient level) under the user's AdamW: its 2-bit rows from FSDP's hook
    bitdp, bitdp_model = _fit("lowbit_bitdp_fsdp", "adamw")
    flat = _full(bitdp_model)
    out["bitdp"] = {"finite": bool(torch.isfinite(flat).all()), "identical": _same_everywhere(flat),
                    "bytes": sum(log.bytes_sent for log in bitdp.strategy.traffic_logs())}
    # 1-bit LAMB and TurboQuant (4-bit all-gather: the link it plans for is set slow) through their names
    for name, optimizer, extra in (("lowbit_lamb_fsdp", "lamb", {}),
                                   ("lowbit_turboquant_fsdp", "turboquant", {"link_bandwidth_gbps": 0.1})):
        trained, trained_model = _fit(_strategy(name, **extra) if extra else name, optimizer)
        flat = _full(trained_model)
        out[optimizer] = {"finite": bool(torch.isfinite(flat).all()), "identical": _same_everywhere(flat),
                          "bytes": sum(log.bytes_sent for log in trained.strategy.traffic_logs()),
                          "steps": trained.global_step}
    # one FSDP group over both nodes, its reduce-scatter int4 in two hops (BitDP at one "node": AdamW)
    world, world_model = _fit(_strategy("lowbit_bitdp_fsdp", fsdp_shard="world", fsdp_reduce_scatter="int4"), "adamw")
    flat = _full(world_model)
    logs = world.strategy.traffic_logs()
    out["world_int4"] = {"finite": bool(torch.isfinite(flat).all()), "identical": _same_everywhere(flat),
                         "mesh": list(world.strategy.device_mesh.mesh.shape),
                         "bytes": sum(log.bytes_sent for log in logs), "node_bytes": sum(log.node_bytes_sent for log in logs)}
    out["wrong_optimizer_error"] = _error("lowbit_lion_fsdp", "adamw")
    # DiLoCo (a round every 3 of the 8 steps) under the user's AdamW: as plain attach_sharded, and the
    # checkpoint after epoch 1 is one step into round 2 (each rank's shard of its worker's weights differs)
    diloco = dict(diloco_sync_every=3)
    trained, trained_model = _fit(_strategy("lowbit_diloco_fsdp", **diloco), "adamw")
    flat = _full(trained_model)
    (workdir / "diloco").mkdir(parents=True, exist_ok=True)
    out["diloco"] = {
        "finite": bool(torch.isfinite(flat).all()), "steps": trained.global_step,
        "rounds": trained.strategy.sync.rounds, "bytes": sum(log.bytes_sent for log in trained.strategy.traffic_logs()),
        "equals_plain": torch.equal(flat, _plain("adamw", LowBitConfig(algorithm="diloco", **diloco))),
        "resume_bit_exact": _resume(lambda: _strategy("lowbit_diloco_fsdp", **diloco), "adamw", flat,
                                    workdir / "diloco")["resume_bit_exact"]}
    # DeMo: each rank's shards with their counterparts on the other node, the update a step late; the
    # checkpoint after epoch 1 holds the exchange in flight
    demo = dict(demo_delay=1)
    trained, trained_model = _fit(_strategy("lowbit_demo_fsdp", **demo), "demo")
    flat = _full(trained_model)
    (workdir / "demo").mkdir(parents=True, exist_ok=True)
    out["demo"] = {
        "finite": bool(torch.isfinite(flat).all()), "identical": _same_everywhere(flat), "steps": trained.global_step,
        "bytes": sum(log.bytes_sent for log in trained.strategy.traffic_logs()),
        "equals_plain": torch.equal(flat, _plain("demo", LowBitConfig(algorithm="demo", **demo))),
        "resume_bit_exact": _resume(lambda: _strategy("lowbit_demo_fsdp", **demo), "demo", flat,
                                    workdir / "demo")["resume_bit_exact"]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", choices=("lion", "adam"), required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    result = (check_lion if args.check == "lion" else check_adam)(out / "ckpt")
    with open(out / f"rank{dist.get_rank()}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    # done: leave without interpreter finalization (tests/distributed.py has the same exit, and why)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
