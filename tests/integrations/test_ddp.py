"""The plain-DDP front end: lowbit_strategy.attach and the per-rank state helpers, on real
gloo process groups, against the single-process references of the algorithm tests."""
import copy
import os
import tempfile

import pytest
import torch
from torch import nn

import lowbit_strategy
from lowbit_strategy import LowBitConfig, LowBitSetupError
from tests.algorithms.lion_cub.test_optimizer import BETAS, LR, STEPS, WD, _batch, _model, _reference_lion_cub
from tests.distributed import run_ranks


def _lion_run(rank, steps, sync_cfg, resume_from=None, directory=None):
    model = nn.parallel.DistributedDataParallel(_model())
    opt = lowbit_strategy.Lion(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    sync = lowbit_strategy.attach(model, [opt], sync_cfg)
    start = 1
    if resume_from is not None:
        weights, optim, entry, start = resume_from
        model.module.load_state_dict(weights)
        opt.load_state_dict(optim)
        lowbit_strategy.load_rank_states(sync, entry, directory)
    for step in range(start, steps + 1):
        model.zero_grad()
        x, y = _batch(rank, step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt, sync


def _check_lion(rank, world_size):
    cfg = LowBitConfig(algorithm="lion", mode="1bit", bucket_size_mb=0.0005)
    model, opt, sync = _lion_run(rank, STEPS, cfg)
    # the DDP hook kept gradients local, the optimizer synchronized: Algorithm 1 exactly
    for a, b in zip(model.module.parameters(), _reference_lion_cub(world_size, "1bit")):
        torch.testing.assert_close(a.detach(), b, rtol=0, atol=1e-6)
    sent = sync.traffic_logs()[0].bytes_sent
    assert sent > 0 and all(r.op.startswith(("majority", "lion.agree")) for r in sync.traffic_logs()[0].records)
    # a checkpoint of every rank's state at step 3, then a resume: the same weights as straight
    half, half_opt, half_sync = _lion_run(rank, 3, cfg)
    # rank 0 writes the file (its own optimizer state + every rank's), every rank loads it
    saved = [lowbit_strategy.save_rank_states(half_sync), half_opt.state_dict()]
    torch.distributed.broadcast_object_list(saved, src=0)
    entry, rank0_optim = saved
    assert entry["world_size"] == world_size
    resumed, _, _ = _lion_run(rank, STEPS, cfg, (copy.deepcopy(half.module.state_dict()), rank0_optim, entry, 4))
    assert all(torch.equal(a, b) for a, b in zip(resumed.module.parameters(), model.module.parameters()))
    _check_rank_files(rank, world_size, cfg, half, half_sync, rank0_optim, model)
    # AdamW under Lion Cub: a clear error naming the fix, before any step
    ddp = nn.parallel.DistributedDataParallel(_model())
    with pytest.raises(LowBitSetupError, match=r"drives lowbit_strategy\.Lion.*torch\.optim\.adamw\.AdamW.*bitdp"):
        lowbit_strategy.attach(ddp, [torch.optim.AdamW(ddp.parameters())], cfg)


def _check_rank_files(rank, world_size, cfg, half, half_sync, rank0_optim, straight):
    """The same resume through per-rank files (no rank holds another's state), and the two
    failures every rank must see together: a failed write, a file a rank cannot see."""
    shared = [tempfile.mkdtemp() if rank == 0 else None]
    torch.distributed.broadcast_object_list(shared, src=0)
    where = os.path.join(shared[0], "states")
    index = [lowbit_strategy.save_rank_states(half_sync, directory=where)]
    torch.distributed.broadcast_object_list(index, src=0)  # rank 0's checkpoint holds the index
    assert index[0] == {"world_size": world_size, "format": "files"}
    assert sorted(os.listdir(where)) == [f"rank_{r:05d}_of_{world_size:05d}.pt" for r in range(world_size)]
    weights = copy.deepcopy(half.module.state_dict())
    resumed, _, _ = _lion_run(rank, STEPS, cfg, (weights, rank0_optim, index[0], 4), directory=where)
    assert all(torch.equal(a, b) for a, b in zip(resumed.module.parameters(), straight.module.parameters()))
    # a write that fails on rank 1 only: every rank raises, naming it
    target = os.path.join(shared[0], "not-a-dir") if rank == 1 else os.path.join(shared[0], "ok")
    if rank == 1:
        open(target, "w").close()  # a file where rank 1's directory should be
    with pytest.raises(RuntimeError, match=r"failed on rank\(s\) \[1\]"):
        lowbit_strategy.save_rank_states(half_sync, directory=target)
    # a file rank 1 cannot see: every rank raises, naming it, before anyone loads anything
    torch.distributed.barrier()
    if rank == 1:
        os.remove(os.path.join(where, f"rank_{1:05d}_of_{world_size:05d}.pt"))
    torch.distributed.barrier()
    with pytest.raises(FileNotFoundError, match=r"rank\(s\) \[1\] cannot see"):
        _lion_run(rank, 4, cfg, (weights, rank0_optim, index[0], 4), directory=where)


def _check_bitdp(rank, world_size):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sync = lowbit_strategy.attach(ddp, [opt], algorithm="bitdp", bits=1, warmup_steps=0, error_feedback=True)
    x = torch.randn(world_size, 5, 8, generator=torch.Generator().manual_seed(3))
    for _ in range(3):  # two warm-up iterations (DDP rebuilds its buckets), then 1-bit codes
        opt.zero_grad()
        ddp(x[rank]).square().sum().backward()
        opt.step()
    assert {r.op for r in sync.traffic_logs()[0].records} >= {"gathered.codes.all_gather", "bitdp.full.allreduce"}
    state = sync.state_dict()
    assert state["iter"] == 3 and set(state["residuals"]) == {"0.weight", "2.weight"}
    entry = lowbit_strategy.save_rank_states(sync)
    if rank == 0:
        assert [s["iter"] for s in entry["states"]] == [3] * world_size
        assert not torch.equal(entry["states"][0]["residuals"]["0.weight"], entry["states"][1]["residuals"]["0.weight"])


def _check_all(rank, world_size):
    _check_lion(rank, world_size)
    _check_bitdp(rank, world_size)


@pytest.mark.slow
def test_attach_on_plain_ddp():
    run_ranks(2, _check_all)


def test_attach_needs_the_ddp_model():
    with pytest.raises(TypeError, match=r"attach needs the DistributedDataParallel model, got Sequential"):
        lowbit_strategy.attach(_model(), [])
