"""One rank of part 3 (:mod:`.ranks` launches P of these): every algorithm through plain DDP,
through Lightning and sharded (FSDP2 inside each node, ``attach_sharded``, the exchange
started from FSDP's hooks during backward), on CUDA tensors (or CPU), over one
``cpu:gloo,cuda:gloo`` process group; rank 0 prints one ``RANKCHECK {json}`` line per run and
saves its final parameters.

Each run trains a 3-layer MLP (0.4M parameters, several DDP buckets, so the defer-one rule
and the side stream have a next bucket to start from) for ``--steps`` steps and checks, at
every step:

* replicas identical (every rank's flattened parameters all-gathered and compared);
* at ``nan_step`` rank 1's loss is NaN: every rank skips the step (parameters unchanged,
  replicas identical, training goes on). BitDP leaves the skip to AMP, as DDP does (the NaN
  reaches every rank's gradient): the run skips as ``GradScaler`` would, after checking
  that every rank saw the non-finite gradient;
* host reads during backward: the Python entry points of ``torch.Tensor`` counted
  (``tests/host_reads.py``) and, on CUDA, ``torch.cuda.set_sync_debug_mode('warn')``'s
  warnings on the main thread (a read the Python counter cannot see, such as a boolean-mask
  index); reads in ``optimizer.step()`` are reported too (the design allows one per step);
* side-stream phases: calls of :meth:`SideStream.run` on a CUDA device (the deferred
  second phases the defer-one rule moves off the compute stream).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import lowbit_strategy as lb
from lowbit_strategy.collectives import streams
from tests.host_reads import READS, HostReads

#: run name -> (LowBitConfig fields, optimizer): every algorithm, in the forms with a deferred
#: second phase (the 1-bit vote, the compensated allreduce, the two-stage TurboQuant mean)
RUNS = {
    "lion_1bit": ({"algorithm": "lion", "mode": "1bit"}, "lion"),
    "lion_lp8": ({"algorithm": "lion", "mode": "lp", "bits": 8}, "lion"),
    "bitdp": ({"algorithm": "bitdp", "bitdp_form": "allgather"}, "adamw"),
    "onebit_adam": ({"algorithm": "onebit_adam"}, "onebit_adam"),
    "onebit_lamb": ({"algorithm": "onebit_lamb"}, "onebit_lamb"),
    "turboquant": ({"algorithm": "turboquant", "turboquant_form": "two_stage"}, "turboquant"),
    # the DCT transforms, top-k and gathers on CUDA tensors (delay 0: the NaN step itself changes nothing)
    "demo": ({"algorithm": "demo", "demo_values": "sign"}, "demo"),
}
#: the layouts part 3 runs: (name, world size, LowBitConfig topology fields)
LAYOUTS = {
    "flat": {"topology": "flat"},
    "2x2": {"topology": "hierarchical", "ranks_per_node": 2},
}
SAMPLES, FEATURES, CLASSES, BATCH = 64, 256, 16, 8
#: torch.distributed calls counted by the device of their tensors (which run on CUDA over gloo)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_to_all_single",
               "broadcast", "reduce_scatter_tensor", "all_gather_object", "broadcast_object_list")


def config(run: str, layout: str, sharded: bool = False) -> lb.LowBitConfig:
    """``run``'s configuration on ``layout``; ``sharded``: the layout's nodes without its
    topology (across nodes is the mesh's replicate dimension)."""
    fields, _ = RUNS[run]
    nodes = {k: v for k, v in LAYOUTS[layout].items() if not (sharded and k == "topology")}
    # a fixed link, so the CUDA and the CPU run pick the same forms (no probe, no timing)
    return lb.LowBitConfig(bucket_size_mb=0.25, warmup_steps=2, link_bandwidth_gbps=1.0, link_latency_us=50.0,
                           **nodes, **fields)


def optimizer(name: str, params, steps: int):
    warm = max(2, steps // 5)
    if name == "lion":
        return lb.Lion(params, lr=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    if name == "onebit_adam":
        return lb.OneBitAdam(params, lr=1e-3, freeze_step=warm)
    if name == "onebit_lamb":
        return lb.OneBitLamb(params, lr=1e-2, freeze_step=warm)  # LAMB's lr scales |w|
    if name == "demo":
        return lb.DeMo(params, lr=1e-3, compression_topk=8)
    return lb.TurboQuantAdamW(params, lr=1e-3, warmup_steps=warm)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                         nn.Linear(512, CLASSES))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(SAMPLES, FEATURES, generator=gen), torch.randint(0, CLASSES, (SAMPLES,), generator=gen)


class Counters:
    """Host reads (Python counter and, on CUDA, sync-debug warnings) and side-stream phases."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        # on CPU ranks, ``numpy()`` of a CPU tensor reads nothing from a device (the CPU-only
        # bit packer uses it); every other read is counted as the CUDA path would make it
        self.reads = HostReads(READS if cuda else tuple(n for n in READS if n != "numpy"))
        self.side = 0
        orig = streams.SideStream.run

        def counted(side, device, handle, phase):
            if device.type == "cuda":
                self.side += 1
            return orig(side, device, handle, phase)

        self._orig, self._counted = orig, counted
        #: (collective, device type of its first tensor) -> calls, over every run
        self.collectives: dict[str, int] = {}
        self._saved: dict[str, object] = {}

    def _count(self, name: str, fn):
        def counted(*args, **kwargs):
            t = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            key = f"{name} ({t.device.type if t is not None else 'objects'})"
            self.collectives[key] = self.collectives.get(key, 0) + 1
            return fn(*args, **kwargs)

        return counted

    def __enter__(self):
        self.reads.__enter__()
        streams.SideStream.run = self._counted
        for name in COLLECTIVES:
            if hasattr(dist, name):  # all_gather_single: newer torch only
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._count(name, self._saved[name]))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        streams.SideStream.run = self._orig
        self.reads.__exit__(*exc)

    def run(self, phase: str, fn):
        """``fn()`` with phase ``phase`` open; returns (result, python reads, sync warnings)."""
        if not self.cuda:
            out = self.reads.run(phase, fn)
            n, where = self.reads.take(phase)
            return out, n, 0, where[:1]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = self.reads.run(phase, fn)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # sync debug mode's own warnings (the mode is a prototype, AccumulateGrad stream notes) are not syncs
        synced = [w for w in seen if "called a synchronizing CUDA operation" in str(w.message)]
        n, where = self.reads.take(phase)
        where = where[:1] + [f"{w.filename}:{w.lineno}: {w.message}" for w in synced[:1]]
        return out, n, len(synced), where


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params])


def _sharded_flat(params, per_node: int) -> torch.Tensor:
    """Every parameter of an FSDP2 model (dim-0 shards over the ``per_node`` ranks of each node)
    flattened whole, from this rank's node's shards: collective (every rank calls it). Plain
    ``all_gather`` rather than ``full_tensor()``, whose functional collective crashed with a
    segmentation fault over gloo on CUDA tensors (torch 2.11, H200)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    node = rank // per_node
    whole = []
    for p in params:
        local = p.to_local().detach()
        rows = -(-p.shape[0] // per_node)
        block = local.new_zeros((rows, *p.shape[1:]))
        block[: local.shape[0]] = local
        every = [torch.empty_like(block) for _ in range(world)]
        dist.all_gather(every, block)
        whole.append(torch.cat(every[node * per_node:(node + 1) * per_node])[: p.shape[0]].reshape(-1))
    return torch.cat(whole)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _identical(flat: torch.Tensor, world: int) -> bool:
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], e) for e in every[1:])


def _all_ranks(flag: bool, device) -> bool:
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() == 1.0)


class Record:
    """What one run found, per step; rank 0 prints it as JSON."""

    def __init__(self, front: str, run: str, layout: str, device, world: int, nan_step: int):
        self.info = {"front_end": front, "run": run, "layout": layout, "device": str(device), "world_size": world,
                     "nan_step": nan_step}
        self.losses: list[float] = []
        self.identical = True
        self.nan_skipped: bool | None = None
        self.backward_reads = self.backward_syncs = self.step_reads_max = self.step_syncs_max = 0
        self.where: list[str] = []

    def reads(self, phase: str, n: int, syncs: int, where: list[str]) -> None:
        if phase == "backward":
            self.backward_reads += n
            self.backward_syncs += syncs
            if (n or syncs) and not self.where:
                self.where = where
        else:
            self.step_reads_max = max(self.step_reads_max, n)
            self.step_syncs_max = max(self.step_syncs_max, syncs)

    def emit(self, counters: Counters, sync, params, out_dir: Path, seconds: float, rank: int, numel: int) -> None:
        sent = sum(log.bytes_sent for log in sync.traffic_logs()) if sync is not None else 0
        if rank != 0:
            return
        i = self.info
        name = f"{i['device'].split(':')[0]}-{i['front_end']}-{i['layout']}-P{i['world_size']}-{i['run']}"
        torch.save(_flat(params).cpu(), out_dir / f"{name}.pt")
        record = {**self.info, "losses": self.losses, "identical": self.identical, "nan_skipped": self.nan_skipped,
                  "backward_reads": self.backward_reads, "backward_syncs": self.backward_syncs,
                  "step_reads_max": self.step_reads_max, "step_syncs_max": self.step_syncs_max,
                  "where": self.where, "side_stream_phases": counters.side,
                  "overlap": bool(getattr(sync, "overlap", False)), "bytes_per_step": sent / max(1, len(self.losses)),
                  "fp32_bytes_per_step": 4 * numel, "ms_per_step": 1e3 * seconds, "params": name}
        print("RANKCHECK " + json.dumps(record), flush=True)


def _train(front: str, run: str, layout: str, args, device, counters: Counters, model: nn.Module, opt, sync,
           whole) -> None:
    """The plain loop of the DDP and sharded runs, checked at every step (module docstring);
    ``whole()``: every parameter flattened whole (collective), compared across ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = data()
    nan_step = args.steps // 2
    rec = Record(front, run, layout, device, world, nan_step)
    start = time.perf_counter()
    for step in range(args.steps):
        idx = torch.arange(BATCH) + BATCH * ((step * world + rank) % (SAMPLES // BATCH))
        out = nn.functional.cross_entropy(model(x[idx].to(device)), y[idx].to(device))
        if step == nan_step and rank == 1:
            out = out * float("nan")
        before = whole().clone() if step == nan_step else None
        opt.zero_grad()
        _, n, syncs, where = counters.run("backward", out.backward)
        rec.reads("backward", n, syncs, where)
        skip = False
        if RUNS[run][1] == "adamw" and step == nan_step:  # BitDP: AMP's skip, as with DDP
            grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
            skip = _all_ranks(not all(bool(torch.isfinite(g).all()) for g in grads), device)
        if not skip:
            _, n, syncs, where = counters.run("step", opt.step)
            rec.reads("step", n, syncs, where)
        rec.losses.append(float(out.detach()))
        flat = whole()
        rec.identical = rec.identical and _identical(flat, world)
        if before is not None:
            rec.nan_skipped = _all_ranks(torch.equal(before, flat) and bool(torch.isfinite(flat).all()), device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    rec.emit(counters, sync, [flat], args.out, (time.perf_counter() - start) / args.steps, rank, flat.numel())
    sync.detach()


def ddp_run(run: str, layout: str, args, device, counters: Counters) -> None:
    counters.side = 0
    net = mlp().to(device)
    ddp = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    opt = optimizer(RUNS[run][1], ddp.parameters(), args.steps)
    sync = lb.attach(ddp, [opt], config(run, layout))
    _train("ddp", run, layout, args, device, counters, ddp, opt, sync, lambda: _flat(ddp.parameters()))


def sharded_run(run: str, layout: str, args, device, counters: Counters) -> None:
    """The DDP run's loop on the model ``fully_shard``-ed inside each node of ``layout`` (each
    linear a unit, the root too) through :func:`lowbit_strategy.attach_sharded`: the
    optimizer-level algorithms start their exchange from FSDP's post-accumulate-grad hooks,
    on FSDP's streams; BitDP sends its rows in the unit's all-reduce hook. Each rank compares
    the parameters its own node's shards make up (across nodes: the replicas)."""
    from torch.distributed.fsdp import fully_shard

    counters.side = 0
    cfg = config(run, layout, sharded=True)
    mesh = lb.node_mesh(device.type, cfg)
    net = mlp().to(device)
    for i in (0, 2, 4):
        fully_shard(net[i], mesh=mesh["shard"])
    fully_shard(net, mesh=mesh["shard"])
    opt = optimizer(RUNS[run][1], net.parameters(), args.steps)
    sync = lb.attach_sharded(net, [opt], cfg, mesh=mesh)
    _train("sharded", run, layout, args, device, counters, net, opt, sync,
           lambda: _sharded_flat(net.parameters(), cfg.ranks_per_node))


def lightning_run(run: str, layout: str, args, device, counters: Counters) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    rank, world = dist.get_rank(), dist.get_world_size()
    nan_step = args.steps // 2
    rec = Record("lightning", run, layout, device, world, nan_step)
    counters.side = 0
    bitdp = RUNS[run][1] == "adamw"

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp()
            self.before = None

        def training_step(self, batch, batch_idx):
            out = nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            rec.losses.append(float(out.detach()))
            if batch_idx == nan_step:
                self.before = _flat(self.parameters()).clone()
                if self.global_rank == 1:
                    out = out * float("nan")
            return out

        def backward(self, loss, *a, **kw):
            _, n, syncs, where = counters.run("backward", lambda: loss.backward(*a, **kw))
            rec.reads("backward", n, syncs, where)

        def configure_optimizers(self):
            return optimizer(RUNS[run][1], self.parameters(), args.steps)

        def optimizer_step(self, epoch, batch_idx, opt, closure):
            closure()  # forward and backward (``backward`` above counts its reads)
            if bitdp and batch_idx == nan_step:  # BitDP: AMP's skip, as with DDP
                finite = all(bool(torch.isfinite(p.grad).all()) for p in self.parameters() if p.grad is not None)
                if _all_ranks(not finite, self.device):
                    return
            _, n, syncs, where = counters.run("step", opt.step)
            rec.reads("step", n, syncs, where)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            flat = _flat(self.parameters())
            rec.identical = rec.identical and _identical(flat, world)
            if batch_idx == nan_step:
                rec.nan_skipped = _all_ranks(torch.equal(self.before, flat) and bool(torch.isfinite(flat).all()),
                                             self.device)

    x, y = data()
    reps = -(-args.steps * BATCH * world // SAMPLES)
    loader = DataLoader(TensorDataset(x.repeat(reps, 1), y.repeat(reps)), batch_size=BATCH, shuffle=False)
    # Lightning's environment: every process is a node of one device (they share the GPU); the
    # config's ranks_per_node redefines the nodes for the 2 x 2 layout
    os.environ.update(NODE_RANK=str(rank), LOCAL_RANK="0")
    strategy = lb.LowBitStrategy(config=config(run, layout), timeout=timedelta(seconds=120))
    trainer = pl.Trainer(accelerator="cuda" if device.type == "cuda" else "cpu", devices=1, num_nodes=world,
                         strategy=strategy, max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    module = Module()
    start = time.perf_counter()
    try:
        trainer.fit(module, loader)
    finally:
        for k in ("NODE_RANK", "LOCAL_RANK"):
            os.environ.pop(k, None)
    rec.emit(counters, strategy.sync, list(module.parameters()), args.out, (time.perf_counter() - start) / args.steps,
             rank, sum(p.numel() for p in module.parameters()))


#: front end -> its run (``--fronts``)
FRONTS = {"ddp": ddp_run, "lightning": lightning_run, "sharded": sharded_run}


def runs_on(front: str, layout: str) -> bool:
    """Whether ``front`` runs on ``layout``: the sharded runs need nodes of several ranks
    (a flat layout is one node, with nothing to exchange across nodes)."""
    return front != "sharded" or "ranks_per_node" in LAYOUTS[layout]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layouts", default="flat")
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--fronts", default=",".join(FRONTS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("cpu:gloo,cuda:gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=120))
    import lightning.pytorch as pl  # noqa: F401  (imported here so a missing Lightning fails every rank alike)

    with Counters(cuda) as counters:
        for layout in args.layouts.split(","):
            for front in (f for f in args.fronts.split(",") if runs_on(f, layout)):
                for run in args.runs.split(","):
                    try:
                        FRONTS[front](run, layout, args, device, counters)
                    except Exception as exc:  # one line per failed run; the group may be unusable after it
                        said = {"front_end": front, "run": run, "layout": layout, "rank": rank,
                                "error": f"{type(exc).__name__}: {exc}"[:800]}
                        print(f"RANKFAIL {json.dumps(said)}", flush=True)
                        raise
    if rank == 0:
        print("RANKCOLLECTIVES " + json.dumps(counters.collectives), flush=True)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # without interpreter finalization: gloo's threads can abort it after a finished run
    os._exit(0)


if __name__ == "__main__":
    main()
