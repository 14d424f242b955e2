"""Q6: get_state_dict/set_state_dict + dcp.save/dcp.load with FSDP2 on mesh["shard"] of a 2x2 mesh (gloo CPU)."""
import os, sys, shutil, copy
import torch, torch.nn as nn, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict, StateDictOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from common import launch, rprint

CK = "docs/design/fsdp2/ckpt"

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(6, 5); self.l1 = nn.Linear(5, 3)
    def forward(self, x): return self.l1(torch.relu(self.l0(x)))

def build(mesh_kind, seed):
    torch.manual_seed(seed)
    m = Net()
    if mesh_kind == "2d":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")); sm = mesh["shard"]
    else:
        sm = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
    fully_shard(m.l0, mesh=sm); fully_shard(m.l1, mesh=sm); fully_shard(m, mesh=sm)
    return m

def step(m, opt, rank):
    # DIVERGE=1: nodes see different data and nothing syncs across nodes -> replicas differ (shows dcp's dedupe caveat)
    seed = rank // 2 if os.environ.get("DIVERGE") == "1" else 0
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(seed))
    m(x).sum().backward(); opt.step(); opt.zero_grad()

def main(rank, world, phase):
    if phase == "save":
        m = build("2d", 0)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        step(m, opt, rank)
        msd, osd = get_state_dict(m, opt)
        if rank == 0:
            rprint(rank, "model sd:", {k: (type(v).__name__, tuple(v.shape), tuple(v.to_local().shape) if isinstance(v, DTensor) else None) for k, v in msd.items()})
            rprint(rank, "optim sd keys:", list(osd.keys()), "state keys:", list(osd["state"].keys())[:2],
                   {k: type(v).__name__ for k, v in osd["state"]["l0.weight"].items()})
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=CK)
        full = {k: v.full_tensor() for k, v in m.state_dict().items()}
        full["exp_avg.l0.weight"] = opt.state[m.l0.weight]["exp_avg"].full_tensor()
        if rank == 0:
            torch.save(full, CK + "_full_ref.pt")
        dist.barrier()
        if rank == 0:
            files = sorted(os.listdir(CK))
            rprint(rank, "ckpt files:", [(f, os.path.getsize(os.path.join(CK, f))) for f in files])
            md = dcp.FileSystemReader(CK).read_metadata()
            for k in ("model.l0.weight", "model.l1.bias"):
                rprint(rank, k, "chunks:", [(tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[k].chunks])
            # which rank wrote each chunk
            wr = {}
            for idx, si in md.storage_data.items():
                if idx.fqn.startswith("model."):
                    wr.setdefault(idx.fqn, []).append((tuple(idx.offset), si.relative_path))
            rprint(rank, "writer of model chunks:", wr)
    else:
        mesh_kind = phase.split("_")[1]   # load_2d or load_1d (resharding to 4-way FSDP)
        m = build(mesh_kind, 123)
        opt = torch.optim.AdamW(m.parameters(), lr=0.1)
        step(m, opt, rank)  # init optimizer state
        msd, osd = get_state_dict(m, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=CK)
        set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        ref = torch.load(CK + "_full_ref.pt")
        ok = all(torch.equal(v.full_tensor(), ref[k]) for k, v in m.state_dict().items())
        ok_opt = torch.equal(opt.state[m.l0.weight]["exp_avg"].full_tensor(), ref["exp_avg.l0.weight"])
        rprint(rank, "optimizer exp_avg matches saved:", ok_opt)
        st = opt.state[m.l0.weight]
        rprint(rank, f"{phase}: model matches saved full tensors: {ok}; optimizer step={st['step'].item()} exp_avg local {tuple(st['exp_avg'].to_local().shape)}")
        # full (non-sharded) state dict on rank 0 via options
        full_sd, _ = get_state_dict(m, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            rprint(rank, "full_state_dict option:", {k: (type(v).__name__, tuple(v.shape)) for k, v in full_sd.items()})

if __name__ == "__main__":
    phase = sys.argv[1]
    if phase == "save":
        shutil.rmtree(CK, ignore_errors=True)
    import torch.multiprocessing as mp
    from common import free_port, _worker
    mp.spawn(_worker, args=(4, free_port(), main, (phase,)), nprocs=4, join=True)
