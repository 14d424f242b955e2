import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from common import launch, rprint
def main(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    rg = mesh["replicate"].get_group(); rr = mesh["replicate"].get_local_rank()
    x = torch.full((3,), rank, dtype=torch.uint8)
    out = torch.empty(6, dtype=torch.uint8); dist.all_gather_single(out, x, group=rg)
    # uneven all_to_all_single: replicate-rank 0 sends [1,2] elems, rank 1 sends [3,1]
    ins = [1, 2] if rr == 0 else [3, 1]
    outs = [1, 3] if rr == 0 else [2, 1]
    inp = torch.arange(sum(ins), dtype=torch.uint8) + 10 * rank
    o2 = torch.empty(sum(outs), dtype=torch.uint8)
    dist.all_to_all_single(o2, inp, output_split_sizes=outs, input_split_sizes=ins, group=rg)
    w = dist.all_gather_single(out.clone(), x, group=rg, async_op=True); w.wait()
    rprint(rank, "all_gather_single uint8", out.tolist(), "| uneven all_to_all_single", o2.tolist(), "| async ok")
    # group-rank <-> global-rank helpers
    rprint(rank, "get_global_rank(rg,1)=", dist.get_global_rank(rg, 1), "get_group_rank(rg, rank)=", dist.get_group_rank(rg, rank))
if __name__ == "__main__":
    launch(main)
