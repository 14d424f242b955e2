"""Q8: custom Lightning strategy subclassing ModelParallelStrategy on CPU/gloo:
(a) ("replicate","shard") mesh, (b) auto fully_shard blocks then root if user did not, (c) register all-reduce hook,
plus block_backward_sync for grad accumulation and a world-size DistributedSampler.
run: timeout 120 python t5_lightning_strategy.py   (Lightning spawns 4 CPU processes itself)
"""
import os
from contextlib import contextmanager
import torch, torch.nn as nn, torch.distributed as dist
import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, FSDPModule


class HSDPHookStrategy(ModelParallelStrategy):
    def __init__(self, num_replicas=2, shard_size=2, block_types=(nn.Linear,), root_attr="model", **kw):
        super().__init__(data_parallel_size=num_replicas, tensor_parallel_size=shard_size, **kw)
        self._R, self._S = num_replicas, shard_size
        self._block_types, self._root_attr = tuple(block_types), root_attr
        self.hook_calls = []

    # (a) mesh ---------------------------------------------------------------
    def setup_environment(self):
        self._setup_distributed()    # ParallelStrategy.setup_environment + init_process_group (gloo on cpu)
        self._device_mesh = init_device_mesh(self.root_device.type, (self._R, self._S),
                                             mesh_dim_names=("replicate", "shard"))
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self):
        # every rank sees different data (DP over the whole world)
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # (b)+(c) ----------------------------------------------------------------
    def _auto_shard(self):
        lm = self.lightning_module
        if not any(isinstance(m, FSDPModule) for m in lm.modules()):
            root = getattr(lm, self._root_attr)
            sm = self._device_mesh["shard"]
            for m in list(root.modules()):
                if m is not root and isinstance(m, self._block_types):
                    fully_shard(m, mesh=sm)
            fully_shard(root, mesh=sm)
        rg = self._device_mesh["replicate"].get_group()
        def hook(buf):                   # stand-in for the compressed cross-node collective
            self.hook_calls.append(buf.numel())
            dist.all_reduce(buf, group=rg); buf.div_(rg.size())
        for m in lm.modules():
            if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_group is not None:
                m.set_all_reduce_hook(hook)

    def setup(self, trainer):
        # == ModelParallelStrategy.setup minus the "configure_model must be overridden" check, plus _auto_shard
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        self._auto_shard()
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @contextmanager
    def block_backward_sync(self):
        # Lightning's ParallelStrategy only handles DDP.no_sync; do the FSDP2 equivalent
        mods = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for m in mods: m.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for m in mods: m.set_requires_gradient_sync(True, recurse=False)


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    def training_step(self, batch, i):
        x, y = batch
        loss = nn.functional.mse_loss(self.model(x), y)
        return loss
    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)
    def on_train_end(self):
        s = self.trainer.strategy
        w = self.model[0].weight
        full = w.full_tensor()
        allw = [torch.empty_like(full) for _ in range(dist.get_world_size())]
        dist.all_gather(allw, full)
        print(f"[rank{self.global_rank}] mesh={s.device_mesh.mesh_dim_names}{tuple(s.device_mesh.shape)} "
              f"type(model)={type(self.model).__name__} w={type(w).__name__}{w.placements} local={tuple(w.to_local().shape)} "
              f"hook_calls={len(s.hook_calls)} replicas identical={all(torch.equal(a, allw[0]) for a in allw)}", flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    dl = torch.utils.data.DataLoader(ds, batch_size=4)
    tr = pl.Trainer(accelerator="cpu", devices=4, strategy=HSDPHookStrategy(), max_steps=3,
                    accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False)
    tr.fit(LM(), dl)
