"""DeMo through the plain-DDP front end against the single-process oracle fed the same codec
(:func:`tests.algorithms.demo.oracle.demo`), computed from the same data on this machine:
every value code with and without the one-step delay, the bytes against the codec's size,
resume with an exchange in flight, a non-finite step, the refused pairs, and the hierarchical
form (2 nodes x 2 ranks). Two launches."""
from __future__ import annotations

import pytest
import torch

import lowbit_strategy
from lowbit_strategy import LowBitConfig
from lowbit_strategy.algorithms.base import LowBitSetupError
from lowbit_strategy.collectives.wire import all_gather_bytes
from tests import training
from tests.algorithms.demo import oracle
from tests.distributed import run_ranks

STEPS = 6
CASES = [dict(values=v, delay=d) for v in ("fp32", "bf16", "sign") for d in (0, 1)]


def cfg(**section):
    return LowBitConfig(algorithm="demo", demo=section, topology="flat")


def _flat(rank, world, tmp):
    for section in CASES:
        ddp, opt, sync = training.train(rank, oracle.make, cfg(**section), STEPS)
        want = oracle.demo(world, STEPS, **section)[rank]
        got = training.flat(ddp.module)
        assert torch.equal(got, training.flat(want)), f"{section}: differs by {(got - training.flat(want)).abs().max()}"
        training.same_on_every_rank(ddp.module)
        # bytes: one all-gather of the codec's payload per step (an exchange in flight not yet counted)
        launched = STEPS - section["delay"]
        assert sync.traffic.bytes_sent == launched * all_gather_bytes(opt.exchange.codec.nbytes, world), section
        assert 0 < sync.metrics()["demo/energy_sent"] < 1
    # resume after step 3, with the exchange of step 3 in flight (delay 1) and without: bit for bit
    for section in (dict(values="sign", delay=1), dict(values="fp32", delay=0)):
        whole, _, _ = training.train(rank, oracle.make, cfg(**section), STEPS)
        ddp, opt, sync = training.train(rank, oracle.make, cfg(**section), 3)
        entry = lowbit_strategy.save_rank_states(sync, f"{tmp}/{section['delay']}")
        if rank == 0:  # the front ends save rank 0's weights and optimizer; the rank state carries the rest
            torch.save((ddp.module.state_dict(), opt.state_dict(), entry), f"{tmp}/{section['delay']}.pt")
        torch.distributed.barrier()
        weights, optim, entry = torch.load(f"{tmp}/{section['delay']}.pt", weights_only=False)
        resumed, _, _ = training.train(rank, oracle.make, cfg(**section), STEPS, start=4,
                                       resume=(weights, optim, entry), directory=f"{tmp}/{section['delay']}")
        assert torch.equal(training.flat(resumed.module), training.flat(whole.module)), section
    # rank 1's loss is inf at step 2: every rank skips that update; the oracle skips it too
    for delay in (0, 1):
        ddp, opt, _ = training.train(rank, oracle.make, cfg(values="sign", delay=delay), 4, nan_at=2)
        assert opt.skipped_steps == 1
        training.same_on_every_rank(ddp.module)
        want = oracle.demo(world, 4, values="sign", delay=delay, nan_at=2)[rank]
        assert torch.equal(training.flat(ddp.module), training.flat(want)), delay
    # debug mode checks the replicas after every step; a diverged replica is one error on every rank
    ddp, opt, sync = training.train(rank, oracle.make, cfg(values="sign").replace(debug=True), 2)
    assert "demo.debug.replicas" in sync.traffic.by_op()
    if rank == 1:
        with torch.no_grad():
            next(ddp.module.parameters()).add_(1.0)
    with pytest.raises(RuntimeError, match=r"worker\(s\) \[1\] differ from worker 0's"):
        opt.zero_grad()
        training.loss(ddp, rank, 3).backward()
        opt.step()
    # the pairs that cannot run, refused on every rank
    with pytest.raises(LowBitSetupError, match=r"pair \(algorithm demo, AdamW\)"):
        training.train(rank, lambda p: torch.optim.AdamW(p), cfg(), 1)
    for other in ("lion", "bitdp", "diloco"):
        with pytest.raises(LowBitSetupError, match=rf"pair \(algorithm='{other}', DeMo\)"):
            training.train(rank, oracle.make, LowBitConfig(algorithm=other, topology="flat"), 1)


@pytest.mark.slow
def test_every_value_code_delay_resume_and_skip_equal_the_oracle(tmp_path):
    run_ranks(2, _flat, str(tmp_path))


def _hierarchical(rank, world):
    for section in (dict(values="sign", delay=0), dict(values="fp32", delay=1)):
        c = cfg(**section).replace(topology="hierarchical", ranks_per_node=2)
        ddp, opt, sync = training.train(rank, oracle.make, c, STEPS)
        assert sync.spec.world_size == 2
        want = oracle.demo(2, STEPS, ranks_per_node=2, **section)[rank // 2]
        assert torch.equal(training.flat(ddp.module), training.flat(want)), section
        training.same_on_every_rank(ddp.module)
        # each node's payload crosses once, split over its two ranks; the node gathers it back
        nbytes = opt.exchange.codec.nbytes
        launched = STEPS - section["delay"]
        half = -(-nbytes // 2)
        mine = max(0, min(nbytes, (rank % 2 + 1) * half) - (rank % 2) * half)
        assert sync.traffic.bytes_sent == launched * all_gather_bytes(max(mine, 1), 2), section
        assert sync.node_traffic.node_bytes_sent > 0 and sync.traffic.node_bytes_sent > 0


@pytest.mark.slow
def test_hierarchical_two_nodes_of_two_ranks_equals_the_oracle_over_nodes():
    run_ranks(4, _hierarchical)
