"""Main prototype (Q1, Q2, Q3, Q5): 2x2 mesh, fully_shard(l0), fully_shard(l1), fully_shard(root)
over mesh["shard"]; set_all_reduce_hook on each unit; verify buffer layout vs p.grad.to_local().
usage: python t1_hook_layout.py [mp=none|bf16|bf16rd] [forcesum=0|1] [mul=2] [xreq=0|1]
"""
import sys, copy
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy, FSDPModule
from torch.distributed.tensor import DTensor
from common import launch, rprint

ARGS = dict(a.split("=") for a in sys.argv[1:])
MP = ARGS.get("mp", "none"); FORCESUM = ARGS.get("forcesum", "0") == "1"
MUL = float(ARGS.get("mul", "2")); XREQ = ARGS.get("xreq", "0") == "1"
GDF = float(ARGS["gdf"]) if "gdf" in ARGS else None

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(5, 3)
        self.l1 = nn.Linear(3, 3)
        self.head = nn.Linear(3, 2)   # owned by the root unit
    def forward(self, x):
        return self.head(torch.relu(self.l1(torch.relu(self.l0(x)))))

def padded_flat_shard(tensors, shard_rank, shard_ws):
    """FSDP2 layout: per param, pad dim0 to multiple of ws, take chunk shard_rank, flatten, concat."""
    out = []
    for t in tensors:
        d0 = t.shape[0]; pd0 = -(-d0 // shard_ws) * shard_ws
        pad = torch.zeros((pd0,) + tuple(t.shape[1:]), dtype=t.dtype); pad[:d0] = t
        out.append(pad.chunk(shard_ws, 0)[shard_rank].reshape(-1))
    return torch.cat(out)

def main(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    sm = mesh["shard"]; srank, sws = sm.get_local_rank(), sm.size()
    torch.manual_seed(0)
    model = MLP(); ref = copy.deepcopy(model)
    mp = {"none": MixedPrecisionPolicy(),
          "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
          "bf16rd": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}[MP]
    units = {"l0": model.l0, "l1": model.l1}
    for n, m in units.items():
        fully_shard(m, mesh=sm, mp_policy=mp)
    fully_shard(model, mesh=sm, mp_policy=mp)
    units["root"] = model
    if FORCESUM:
        for m in units.values(): m.set_force_sum_reduction_for_comms(True)
    if GDF is not None:
        for m in units.values(): m.set_gradient_divide_factor(GDF)
    st = model._get_fsdp_state()
    pg = st._fsdp_param_group
    if rank == 0:
        rprint(rank, "root mesh_info", type(pg.mesh_info).__name__, "RS pg ranks",
               dist.get_process_group_ranks(pg._reduce_scatter_process_group),
               "AG pg ranks", dist.get_process_group_ranks(pg._all_gather_process_group))
    log = []
    def make_hook(name):
        def hook(buf):
            log.append((name, tuple(buf.shape), buf.dtype, buf.clone(), buf.data_ptr()))
            buf.mul_(MUL)
        return hook
    for n, m in units.items():
        m.set_all_reduce_hook(make_hook(n))
    # Q5 info
    for n, p in model.named_parameters():
        if rank in (0, 1):
            rprint(rank, f"param {n}: type={type(p).__name__} numel={p.numel()} shape={tuple(p.shape)} "
                   f"local={tuple(p.to_local().shape)} placements={p.placements} mesh_dims={p.device_mesh.mesh_dim_names}")
    torch.manual_seed(100 + rank)
    x = torch.randn(4, 5, requires_grad=XREQ)
    out = model(x); out.float().pow(2).sum().backward()
    # reference grads of every rank
    xr = x.detach().clone().requires_grad_(XREQ)
    ref_in = ref
    if MP != "none":   # emulate bf16 compute for the reference
        ref_in = copy.deepcopy(ref).to(torch.bfloat16); xr = xr.to(torch.bfloat16)
    ref_in(xr).float().pow(2).sum().backward()
    names = [n for n, _ in ref.named_parameters()]
    my = torch.cat([p.grad.float().reshape(-1) for p in ref_in.parameters()])
    allg = [torch.empty_like(my) for _ in range(world)]; dist.all_gather(allg, my)
    node = rank // 2
    node_sum = allg[2 * node] + allg[2 * node + 1]
    # unflatten node_sum into per-param tensors
    per, off = {}, 0
    for n, p in ref.named_parameters():
        per[n] = node_sum[off:off + p.numel()].view(p.shape); off += p.numel()
    unit_params = {"l0": ["l0.weight", "l0.bias"], "l1": ["l1.weight", "l1.bias"], "root": ["head.weight", "head.bias"]}
    if rank in (0, 1):
        rprint(rank, "hook order:", [e[0] for e in log])
    ok = True
    for name, shape, dtype, clone, ptr in log:
        exp_sum = padded_flat_shard([per[n] for n in unit_params[name]], srank, sws)
        tol = 1e-5 if MP == "none" else 3e-2
        is_sum = torch.allclose(clone.float(), exp_sum, atol=tol, rtol=tol)
        is_avg = torch.allclose(clone.float(), exp_sum / 2, atol=tol, rtol=tol)
        # map buffer -> p.grad.to_local()
        params = dict(model.named_parameters())
        off = 0; views = []
        post = (GDF or 2.0) if FORCESUM else 1.0      # FSDP divides after the hook when it used SUM
        for n in unit_params[name]:
            p = params[n]; g = p.grad; loc = g.to_local()
            d0 = p.shape[0]; pd0 = -(-d0 // sws) * sws
            padded_numel = (pd0 // sws) * (p.numel() // d0 if d0 else 0)
            seg = clone[off:off + loc.numel()].view(loc.shape).float()
            match = torch.allclose(loc.float(), seg * MUL / post, atol=tol, rtol=tol)
            same_storage = (loc.untyped_storage().data_ptr() == ptr)
            views.append(f"{n}: grad={type(g).__name__} local{tuple(loc.shape)} {loc.dtype} off={off} pad_numel={padded_numel} "
                         f"match(buf*{MUL}/{post})={match} view_of_buf={same_storage}")
            ok &= match
            padvals = clone[off + loc.numel(): off + padded_numel]
            if padvals.numel():
                views.append(f"    padding of {n}: {padvals.numel()} elems, all zero={bool((padvals == 0).all())}")
            off += padded_numel
        if rank in (0, 1):
            rprint(rank, f"unit {name}: buf shape={shape} dtype={dtype} is_SUM={is_sum} is_AVG={is_avg} total_padded={off}")
            for v in views: rprint(rank, "    ", v)
    rprint(rank, "ALL_MATCH", ok)

if __name__ == "__main__":
    launch(main)
