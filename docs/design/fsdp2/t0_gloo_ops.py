# Q1: 2-D mesh on CPU/gloo, which PGs, and our own collectives on mesh["replicate"]
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from common import launch, rprint

def main(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    rep, sh = mesh["replicate"], mesh["shard"]
    rg, sg = rep.get_group(), sh.get_group()
    rprint(rank, "mesh", mesh.mesh.tolist(), "rep ranks", dist.get_process_group_ranks(rg),
           "shard ranks", dist.get_process_group_ranks(sg), "rep backend", dist.get_backend(rg),
           "rep local rank", rep.get_local_rank(), "shard local rank", sh.get_local_rank())
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.uint8):
        x = torch.full((4,), rank + 1, dtype=dtype)
        res = {}
        try:
            y = x.clone(); dist.all_reduce(y, group=rg); res["all_reduce_sum"] = y.tolist()
        except Exception as e: res["all_reduce_sum"] = "ERR " + str(e)[:80]
        try:
            out = torch.empty(8, dtype=dtype); dist.all_gather_into_tensor(out, x, group=rg); res["all_gather_into_tensor"] = out.tolist()
        except Exception as e: res["all_gather_into_tensor"] = "ERR " + str(e)[:80]
        try:
            out = torch.empty(4, dtype=dtype); dist.all_to_all_single(out, x + torch.arange(4).to(dtype), group=rg); res["all_to_all_single"] = out.tolist()
        except Exception as e: res["all_to_all_single"] = "ERR " + str(e)[:80]
        try:
            out = torch.empty(2, dtype=dtype); dist.reduce_scatter_tensor(out, x, group=rg); res["reduce_scatter_tensor"] = out.tolist()
        except Exception as e: res["reduce_scatter_tensor"] = "ERR " + str(e)[:80]
        try:
            y = x.clone(); dist.all_reduce(y, op=dist.ReduceOp.AVG, group=rg); res["all_reduce_AVG"] = y.tolist()
        except Exception as e: res["all_reduce_AVG"] = "ERR " + str(e)[:100]
        try:
            out = torch.empty(2, dtype=dtype); dist.reduce_scatter_tensor(out, x, op=dist.ReduceOp.AVG, group=sg); res["reduce_scatter_AVG"] = out.tolist()
        except Exception as e: res["reduce_scatter_AVG"] = "ERR " + str(e)[:100]
        try:
            out = torch.empty(2, dtype=dtype); dist.reduce_scatter_tensor(out, x, op=dist._make_nccl_premul_sum(0.5), group=sg); res["reduce_scatter_PREMUL"] = out.tolist()
        except Exception as e: res["reduce_scatter_PREMUL"] = "ERR " + str(e)[:100]
        # async work
        try:
            y = x.clone(); w = dist.all_reduce(y, group=rg, async_op=True); w.wait(); res["async_all_reduce"] = y.tolist()
        except Exception as e: res["async_all_reduce"] = "ERR " + str(e)[:80]
        if rank in (0, 2):
            for k, v in res.items(): rprint(rank, dtype, k, v)

if __name__ == "__main__":
    launch(main)
