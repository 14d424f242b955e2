"""The setup handshake: ranks that disagree on their configuration, the package version, the
model or the optimizers get one clear error on every rank, naming the fields and the ranks,
instead of a hang until the process group's timeout or one rank aborting (2 gloo ranks)."""

import os

import pytest
import torch
from torch import nn

import lowbit_strategy
from lowbit_strategy import ConfigMismatchError, Lion, LowBitConfig
from tests.distributed import run_ranks
from tests.training import loss, model

#: (what differs, rank 0's config fields, rank 1's, the message must name)
MISMATCHES = [
    ("debug on rank 0 only", dict(debug=True), dict(debug=False), r"debug: True on rank\(s\) \[0\]; False on rank\(s\) \[1\]"),
    ("bits", dict(mode="lp", bits=8), dict(mode="lp", bits=16), r"lion\.bits: 8 on rank\(s\) \[0\]; 16 on rank\(s\) \[1\]"),
    ("overlap", dict(lion={"overlap": True}), dict(lion={"overlap": False}), r"lion\.overlap: True on rank\(s\) \[0\]"),
    ("algorithm", dict(algorithm="lion"), dict(algorithm="bitdp"), r"algorithm: 'lion' on rank\(s\) \[0\]; 'bitdp'"),
]


def _check(rank, world_size):
    for what, mine, theirs, pattern in MISMATCHES:
        ddp = nn.parallel.DistributedDataParallel(model())
        cfg = LowBitConfig(**(mine if rank == 0 else theirs))
        opt = Lion(ddp.parameters(), lr=1e-3) if cfg.algorithm == "lion" else torch.optim.AdamW(ddp.parameters())
        with pytest.raises(ConfigMismatchError, match=pattern) as caught:
            lowbit_strategy.attach(ddp, [opt], cfg)
        assert "differs across ranks" in str(caught.value) and "LOWBIT_" in str(caught.value), what
        every = [None] * world_size  # the same message on every rank
        torch.distributed.all_gather_object(every, str(caught.value))
        assert every[0] == every[1], what
    # optimizers that differ: caught at attach, before any step
    ddp = nn.parallel.DistributedDataParallel(model())
    opt = Lion(ddp.parameters(), lr=1e-3 if rank == 0 else 2e-3)
    with pytest.raises(ConfigMismatchError, match=r"optimizer\[0\]\.param_groups\[0\].*rank\(s\) \[0\].*rank\(s\) \[1\]"):
        lowbit_strategy.attach(ddp, [opt], LowBitConfig())
    # the same everywhere: the run trains (the handshake adds two small collectives at setup)
    ddp = nn.parallel.DistributedDataParallel(model())
    opt = Lion(ddp.parameters(), lr=1e-3)
    sync = lowbit_strategy.attach(ddp, [opt], LowBitConfig(debug=True))
    loss(ddp, rank, 1).backward()
    opt.step()
    assert sync.traffic_logs()[0].bytes_sent > 0


@pytest.mark.slow
def test_ranks_that_disagree_all_get_the_same_clear_error():
    run_ranks(2, _check)


def _accelerate(rank, world_size):
    pytest.importorskip("accelerate")
    from lowbit_strategy.accelerate import LowBitAccelerator

    # one process exported a different LOWBIT_* variable than the other
    os.environ["LOWBIT_BITS"] = "8" if rank == 0 else "4"
    os.environ["LOWBIT_MODE"] = "sign"
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))  # what accelerate launch gives a rank
    acc = LowBitAccelerator(cpu=True)
    net = model()
    opt = Lion(net.parameters(), lr=1e-3)
    with pytest.raises(ConfigMismatchError, match=r"lion\.bits: 8 on rank\(s\) \[0\]; 4 on rank\(s\) \[1\]"):
        acc.prepare(net, opt)


@pytest.mark.slow
def test_an_environment_variable_exported_in_one_process_only_under_accelerate():
    run_ranks(2, _accelerate)
