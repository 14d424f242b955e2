"""Q3 (units without grads, root, order) and Q4 (grad accumulation with set_requires_gradient_sync)."""
import sys, copy
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy
from common import launch, rprint

ARGS = dict(a.split("=") for a in sys.argv[1:])
UNUSED_RS = ARGS.get("rs_unused", "0") == "1"
MP = ARGS.get("mp", "none")
NOSKIP = ARGS.get("noskip", "0") == "1"

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l0 = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)       # requires_grad=False
        self.skipped = nn.Linear(4, 4)      # never called in forward
        self.cond = nn.Linear(4, 4)         # called on all ranks; output used only on node 0
        self.l1 = nn.Linear(4, 4)
        for p in self.frozen.parameters(): p.requires_grad_(False)
        self.node = 0
    def forward(self, x):
        h = torch.relu(self.l0(x))
        h = self.frozen(h)
        c = self.cond(h)
        if self.node == 0:
            h = h + c
        return self.l1(h)

def main(rank, world):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    sm = mesh["shard"]
    torch.manual_seed(0)
    model = Net(); model.node = rank // 2
    ref = copy.deepcopy(model)
    mp = MixedPrecisionPolicy() if MP == "none" else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    names = ["l0", "frozen", "skipped", "cond", "l1"]
    if NOSKIP:
        del model.skipped; names.remove("skipped")
    for n in names:
        fully_shard(getattr(model, n), mesh=sm, mp_policy=mp)
    fully_shard(model, mesh=sm, mp_policy=mp)
    if UNUSED_RS:
        model.set_reduce_scatter_unused_params(True)
    log = []
    def mk(n):
        def hook(buf):
            log.append((n, buf.numel(), buf.clone()))
        return hook
    for n in names: getattr(model, n).set_all_reduce_hook(mk(n))
    model.set_all_reduce_hook(mk("root"))
    # ---- Q3: one step
    torch.manual_seed(10 + rank)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    rprint(rank, "step1 hooks (unit, numel):", [(n, k) for n, k, _ in log])
    rprint(rank, "grads None?:", {n: p.grad is None for n, p in model.named_parameters()})
    # ---- Q4: accumulation over 3 micro-batches
    model.zero_grad(set_to_none=True); log.clear()
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(1000 + 7 * rank + i)) for i in range(3)]
    for i, xi in enumerate(xs):
        last = i == len(xs) - 1
        model.set_requires_gradient_sync(last)
        model(xi).sum().backward()
        rprint(rank, f"micro {i} sync={last}: hooks so far {[(n, k) for n, k, _ in log]}; "
               f"l1.weight.grad is None: {model.l1.weight.grad is None}; "
               f"unsharded accumulated? {model.l1._get_fsdp_state()._fsdp_param_group.fsdp_params[0].unsharded_param.grad is not None if not last else '-'}")
    # check the accumulated grad equals node-average of summed micro grads
    r = copy.deepcopy(ref)
    if MP != "none": r = r.to(torch.bfloat16)
    for xi in xs:
        r(xi.to(next(r.parameters()).dtype)).float().sum().backward()
    g = r.l1.weight.grad.float().reshape(-1)
    allg = [torch.empty_like(g) for _ in range(world)]; dist.all_gather(allg, g)
    node = rank // 2
    avg = ((allg[2 * node] + allg[2 * node + 1]) / 2).view(4, 4)
    srank = sm.get_local_rank()
    exp = avg.chunk(2, 0)[srank]
    tol = 1e-5 if MP == "none" else 5e-2
    rprint(rank, "accumulated l1.weight grad == node-avg(sum of micro grads):",
           torch.allclose(model.l1.weight.grad.to_local(), exp, atol=tol, rtol=tol))

if __name__ == "__main__":
    launch(main)
