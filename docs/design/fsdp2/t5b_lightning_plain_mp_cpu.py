"""Does the stock ModelParallelStrategy run on CPU (gloo)? 2 processes, mesh (data_parallel=2, tensor_parallel=1)."""
import torch, torch.nn as nn
import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard

class LM(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    def configure_model(self):
        dp = self.device_mesh["data_parallel"]
        for m in self.model:
            if isinstance(m, nn.Linear): fully_shard(m, mesh=dp)
        fully_shard(self.model, mesh=dp)
    def training_step(self, b, i):
        return nn.functional.mse_loss(self.model(b[0]), b[1])
    def configure_optimizers(self): return torch.optim.AdamW(self.model.parameters(), lr=1e-2)
    def on_train_end(self):
        print(f"[rank{self.global_rank}] stock ModelParallelStrategy on CPU OK: mesh={self.device_mesh} "
              f"backend={torch.distributed.get_backend()} w={type(self.model[0].weight).__name__}", flush=True)

if __name__ == "__main__":
    ds = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    pl.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
               max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False).fit(LM(), torch.utils.data.DataLoader(ds, batch_size=4))
