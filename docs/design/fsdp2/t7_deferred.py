"""Is p.grad a view of the hook buffer after backward (so an async/deferred cross-node op can write into it later)?
Case A: grads None before backward -> view.  Case B: grads already exist (no zero_grad / set_to_none=False) -> accumulated copy."""
import torch, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from common import launch, rprint

def main(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(m[0], mesh=mesh["shard"]); fully_shard(m[1], mesh=mesh["shard"]); fully_shard(m, mesh=mesh["shard"])
    bufs = []
    for u in (m[0], m[1]): u.set_all_reduce_hook(lambda b: bufs.append(b))
    for case, zero in (("A set_to_none", True), ("B grads kept (zero_grad(set_to_none=False))", False)):
        bufs.clear()
        m.zero_grad(set_to_none=zero)
        m(torch.randn(3, 4)).sum().backward()
        for b in bufs: b.fill_(7.0)   # deferred write after backward
        g = m[0].weight.grad.to_local()
        rprint(rank, f"case {case}: after deferred buf.fill_(7) p.grad local all 7? {bool((g == 7).all())}")

if __name__ == "__main__":
    launch(main)
