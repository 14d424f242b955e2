"""Q9: Accelerate on multi-process CPU. run: timeout 120 torchrun --nproc-per-node 2 t6_accelerate.py"""
import os, torch, torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin

plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
acc = Accelerator(cpu=True, fsdp_plugin=plugin)
r = acc.process_index
print(f"[r{r}] distributed_type={acc.distributed_type} is_fsdp2={acc.is_fsdp2} backend={acc.state.backend} "
      f"state.fsdp_plugin={getattr(acc.state, 'fsdp_plugin', None) is not None}", flush=True)
# plain model -> what does prepare do?
m = nn.Linear(4, 4); o = torch.optim.SGD(m.parameters(), lr=0.1)
pm, po = acc.prepare(m, o)
print(f"[r{r}] plain model prepared as {type(pm).__name__}", flush=True)
# already fully_shard-ed model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
mesh = init_device_mesh("cpu", (acc.num_processes,))
m2 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)); fully_shard(m2[0], mesh=mesh); fully_shard(m2, mesh=mesh)
o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
try:
    pm2, po2 = acc.prepare(m2, o2)
    print(f"[r{r}] FSDP2 model prepared as {type(pm2).__name__}", flush=True)
except Exception as e:
    print(f"[r{r}] FSDP2 model prepare ERR {type(e).__name__}: {str(e)[:200]}", flush=True)
# fsdp2_prepare_model directly on an FSDPModule (early return)
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
print(f"[r{r}] fsdp2_prepare_model(FSDPModule) returns same object: {fsdp2_prepare_model(acc, m2) is m2}", flush=True)
# workaround on MULTI_CPU: do not pass the FSDP2 model to prepare(); prepare optimizer only; or prepare_model(evaluation_mode=True)
m3 = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)); fully_shard(m3[0], mesh=mesh); fully_shard(m3, mesh=mesh)
o3 = acc.prepare(torch.optim.SGD(m3.parameters(), lr=0.1))
pm3 = acc.prepare_model(m3, evaluation_mode=True)
loss = pm3(torch.randn(2, 4)).sum(); acc.backward(loss); o3.step(); o3.zero_grad()
print(f"[r{r}] workaround: optimizer-only prepare + prepare_model(evaluation_mode=True) -> {type(pm3).__name__}, step OK; "
      f"no_sync handles FSDP2 only if is_fsdp2 ({acc.is_fsdp2})", flush=True)
