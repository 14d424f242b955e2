"""The collectives' NCCL test mode (:mod:`lowbit_strategy.collectives.emulation`): it catches
a read that does not wait for its collective, and code that follows the rules gives the same
bits with it as on plain gloo, for every algorithm (2 ranks, plain DDP front end) and for the
sharded path's exchange started during backward (2 nodes x 2 ranks, FSDP2)."""

import os

import pytest
import torch
from torch import nn

import lowbit_strategy
from lowbit_strategy import Lion, LowBitConfig, OneBitAdam, OneBitLamb, TurboQuantAdamW
from tests.distributed import run_ranks
from tests.training import flat, loss, model

STEPS = 5
CASES = {
    "lion-1bit": (dict(algorithm="lion", mode="1bit"), lambda ps: Lion(ps, lr=1e-3)),
    "lion-lp": (dict(algorithm="lion", mode="lp", bits=8), lambda ps: Lion(ps, lr=1e-3)),
    "bitdp-2": (dict(algorithm="bitdp", warmup_steps=1), lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    "onebit_adam": (dict(algorithm="onebit_adam"), lambda ps: OneBitAdam(ps, lr=1e-3, freeze_step=2)),
    "onebit_lamb": (dict(algorithm="onebit_lamb"), lambda ps: OneBitLamb(ps, lr=1e-3, freeze_step=2)),
    "turboquant-ag": (dict(algorithm="turboquant", turboquant_form="allgather", turboquant_block=16),
                      lambda ps: TurboQuantAdamW(ps, lr=1e-3, warmup_steps=2)),
    "turboquant-2s": (dict(algorithm="turboquant", turboquant_form="two_stage", turboquant_block=16),
                      lambda ps: TurboQuantAdamW(ps, lr=1e-3, warmup_steps=2)),
    "diloco-sign": (dict(algorithm="diloco", diloco_sync_every=2, diloco_compression="sign"),
                    lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    "diloco-stream": (dict(algorithm="diloco", diloco_sync_every=4, diloco_fragments=2, diloco_delay=1),
                      lambda ps: torch.optim.AdamW(ps, lr=1e-3)),
    "demo-sign-delay": (dict(algorithm="demo", demo_values="sign", demo_delay=1),
                        lambda ps: lowbit_strategy.DeMo(ps, lr=1e-3, compression_topk=4)),
}


def _train_all(rank, world_size, out_dir):
    from lowbit_strategy.collectives import emulation

    results = {}
    for name, (kw, make) in CASES.items():
        ddp = nn.parallel.DistributedDataParallel(model())
        opt = make(ddp.parameters())
        lowbit_strategy.attach(ddp, [opt], LowBitConfig(bucket_size_mb=0.0005, **kw))
        for step in range(1, STEPS + 1):
            opt.zero_grad()
            loss(ddp, rank, step).backward()
            opt.step()
        results[name] = flat(ddp)
    torch.save({"active": emulation.ACTIVE, "weights": results}, os.path.join(out_dir, f"rank{rank}.pt"))


def _train_sharded(rank, world_size, out_dir):
    """The sharded path at 2 nodes x 2 ranks (FSDP2 inside the node), its exchange started
    during backward from FSDP2's hooks and waited for at the step."""
    from lowbit_strategy.collectives import emulation
    from tests.integrations.test_sharded import CASES as SHARDED, PER_NODE, STEPS as SHARDED_STEPS, _full, _sharded

    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=PER_NODE))
    results = {}
    for name in ("lion_1bit", "onebit_adam", "turboquant"):
        cfg, make_opt, _ = SHARDED[name]
        net, _, _ = _sharded(rank, cfg, make_opt, SHARDED_STEPS, mesh)
        results[name] = torch.cat([t.reshape(-1) for t in _full(net)])
    torch.save({"active": emulation.ACTIVE, "weights": results}, os.path.join(out_dir, f"rank{rank}.pt"))


def _run(tmp_path, mode: str, train=_train_all, ranks: int = 2) -> dict:
    out = tmp_path / mode
    out.mkdir()
    before = os.environ.get("LOWBIT_EMULATE_NCCL")
    os.environ["LOWBIT_EMULATE_NCCL"] = "1" if mode == "nccl" else "0"  # read by the spawned ranks
    try:
        run_ranks(ranks, train, str(out))
    finally:
        if before is None:
            os.environ.pop("LOWBIT_EMULATE_NCCL")
        else:
            os.environ["LOWBIT_EMULATE_NCCL"] = before
    return {r: torch.load(out / f"rank{r}.pt") for r in range(ranks)}


@pytest.mark.slow
def test_every_algorithm_gives_the_same_bits_with_nccl_semantics_as_on_gloo(tmp_path):
    gloo, nccl = _run(tmp_path, "gloo"), _run(tmp_path, "nccl")
    assert [gloo[r]["active"] for r in range(2)] == [False, False]
    assert [nccl[r]["active"] for r in range(2)] == [True, True]
    for name in CASES:
        for r in range(2):
            assert torch.equal(nccl[r]["weights"][name], gloo[r]["weights"][name]), f"{name}, rank {r}"
        if not name.startswith("diloco"):  # (local updates: the workers differ between syncs)
            assert torch.equal(gloo[0]["weights"][name], gloo[1]["weights"][name]), f"{name}: replicas differ"


@pytest.mark.slow
def test_the_sharded_exchange_started_in_backward_gives_the_same_bits_with_nccl_semantics(tmp_path):
    gloo = _run(tmp_path, "gloo", _train_sharded, 4)
    nccl = _run(tmp_path, "nccl", _train_sharded, 4)
    assert [nccl[r]["active"] for r in range(4)] == [True] * 4 and not any(gloo[r]["active"] for r in range(4))
    for name, weights in gloo[0]["weights"].items():
        for r in range(4):
            assert torch.equal(nccl[r]["weights"][name], weights), f"{name}, rank {r}"
            assert torch.equal(gloo[r]["weights"][name], weights), f"{name}: replicas differ"


def _early_reads(rank, world_size):
    from lowbit_strategy.collectives import emulation
    from lowbit_strategy.collectives import group as g

    assert emulation.ACTIVE
    out = torch.empty(2 * world_size)
    fut = g.all_gather_async(out, torch.tensor([rank, rank + 10.0]), None, "probe")
    assert fut.done()  # complete when queued, as on NCCL
    assert torch.isnan(fut.value()).all()  # value() does not wait for the data
    early = torch.futures.collect_all([fut])
    assert early.done() and torch.isnan(out).all()  # nor does collect_all (no devices)
    chained = fut.then(lambda f: f.value().clone())  # a then() chained from the collective sees it
    assert chained.wait().tolist() == [0.0, 10.0, 1.0, 11.0]
    assert fut.wait().tolist() == [0.0, 10.0, 1.0, 11.0]  # and so does its own wait()


@pytest.mark.slow
def test_the_mode_catches_reads_that_do_not_wait():
    before = os.environ.get("LOWBIT_EMULATE_NCCL")
    os.environ["LOWBIT_EMULATE_NCCL"] = "1"
    try:
        run_ranks(2, _early_reads)
    finally:
        if before is None:
            os.environ.pop("LOWBIT_EMULATE_NCCL")
        else:
            os.environ["LOWBIT_EMULATE_NCCL"] = before
