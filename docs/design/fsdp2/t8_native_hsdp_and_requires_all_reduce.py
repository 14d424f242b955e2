"""Contrast: native HSDP (fully_shard(mesh=2-D)) vs our 1-D + hook; effect of set_requires_all_reduce(False) on the hook."""
import torch, torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from common import launch, rprint

def run(mesh, rank, tag):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(m[0], mesh=mesh); fully_shard(m[1], mesh=mesh); fully_shard(m, mesh=mesh)
    calls = []
    for u in (m[0], m[1]): u.set_all_reduce_hook(lambda b: calls.append(b.clone()))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    m(x).sum().backward()
    n1 = len(calls)
    m.set_requires_all_reduce(False)
    m(x).sum().backward()
    rprint(rank, f"{tag}: hook calls normal step={n1}; with set_requires_all_reduce(False)={len(calls) - n1}; "
           f"placements={m[0].weight.placements}; first buf={calls[0][:3].tolist()}")

def main(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    run(mesh, rank, "native HSDP 2-D mesh")
    run(mesh["shard"], rank, "1-D mesh['shard']")

if __name__ == "__main__":
    launch(main)
