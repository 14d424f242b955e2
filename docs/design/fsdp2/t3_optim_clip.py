"""Q5 (DTensor params, empty local shards, optimizer state, AdamW foreach) and Q7 (clip_grad_norm_)."""
import copy
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from common import launch, rprint

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(4, 3)
        self.l1 = nn.Linear(3, 1)     # weight (1,3), bias (1,): rank 1 of each shard group gets EMPTY local shards
    def forward(self, x):
        return self.l1(torch.tanh(self.l0(x)))

def main(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    sm, rm = mesh["shard"], mesh["replicate"]
    torch.manual_seed(0)
    model = Net(); ref = copy.deepcopy(model)
    fully_shard(model.l0, mesh=sm); fully_shard(model.l1, mesh=sm); fully_shard(model, mesh=sm)
    # our cross-node averaging inside the hook (plain all_reduce stands in for the compressed collective)
    rg = rm.get_group()
    def hook(buf):
        dist.all_reduce(buf, group=rg); buf.div_(rg.size())
    for m in (model.l0, model.l1, model): m.set_all_reduce_hook(hook)
    p = model.l1.bias
    z = torch.zeros_like(p)
    rprint(rank, f"l1.bias numel={p.numel()} local={tuple(p.to_local().shape)}; l1.weight local={tuple(model.l1.weight.to_local().shape)}; "
           f"zeros_like -> {type(z).__name__} {z.placements} local={tuple(z.to_local().shape)}")
    for foreach in (True, False):
        m = copy.deepcopy(ref) if False else None
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, foreach=True)
    xs_all = torch.randn(world, 2, 4, generator=torch.Generator().manual_seed(5))
    for step in range(3):
        opt.zero_grad(); ref_opt.zero_grad()
        model(xs_all[rank]).pow(2).sum().backward()
        if step == 0:
            rprint(rank, "p.grad type", type(p.grad).__name__, p.grad.placements, "local", tuple(p.grad.to_local().shape))
        # reference: global average grad of all 4 ranks on a plain model
        ref(xs_all).pow(2).sum(dim=(1, 2)).mean().backward()
        # Q7 clip (before step) on both
        tn = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        rtn = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.5)
        if step == 0:
            rprint(rank, f"clip total_norm type={type(tn).__name__} "
                   f"{(tn.placements, tn.device_mesh.mesh_dim_names) if isinstance(tn, DTensor) else ''} "
                   f"value={tn.full_tensor().item() if isinstance(tn, DTensor) else tn.item():.6f} ref={rtn.item():.6f}")
        opt.step(); ref_opt.step()
    ok = all(torch.allclose(p.full_tensor(), q, atol=1e-5) for p, q in zip(model.parameters(), ref.parameters()))
    st = opt.state[model.l1.bias]
    rprint(rank, "after 3 AdamW(foreach) steps params == reference:", ok,
           "| state types:", {k: (type(v).__name__, tuple(v.to_local().shape) if isinstance(v, DTensor) else tuple(v.shape)) for k, v in st.items()})
    # fused AdamW on CPU DTensors?
    try:
        o2 = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        model(xs_all[rank]).sum().backward(); o2.step(); rprint(rank, "fused AdamW on CPU DTensor: OK")
    except Exception as e:
        rprint(rank, "fused AdamW on CPU DTensor: ERR", type(e).__name__, str(e)[:150])
    # Q7 detail: norm of node-local (non-synced across nodes) grads -> reduced over shard group only?
    for m in (model.l0, model.l1, model): m.set_all_reduce_hook(lambda b: None)
    model.zero_grad()
    model(xs_all[rank]).pow(2).sum().backward()
    local_sq = sum(g.grad.to_local().pow(2).sum() for g in model.parameters())
    sg_sq = local_sq.clone(); dist.all_reduce(sg_sq, group=sm.get_group())
    all_sq = local_sq.clone(); dist.all_reduce(all_sq)
    tn = torch.nn.utils.get_total_norm([q.grad for q in model.parameters()])
    rprint(rank, f"no-cross-node grads: get_total_norm={tn.full_tensor().item():.6f} shard-group norm={sg_sq.sqrt().item():.6f} "
           f"world norm={all_sq.sqrt().item():.6f} ; tn placements {tn.placements}")

if __name__ == "__main__":
    launch(main)
