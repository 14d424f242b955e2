"""DiLoCo through the plain-DDP front end against the single-process oracle
(:mod:`tests.algorithms.diloco.oracle`), computed from the same data on this machine.

Every compression, the streaming form (fragments, delay, mixing), the hierarchical form
(2 nodes x 2 ranks: the node's exact mean inside, the exchange across), the bytes against
the exchange's formula, resume at and between round boundaries, a non-finite round, and
the inner optimizers it refuses: a few launches, each running many configurations.
"""
from __future__ import annotations

import pytest
import torch

import lowbit_strategy
from lowbit_strategy import LowBitConfig
from lowbit_strategy.algorithms.base import LowBitSetupError
from lowbit_strategy.algorithms.diloco import exchange as ex
from tests import training
from tests.algorithms.diloco import oracle
from tests.distributed import run_ranks

COMPRESSIONS = ("fp32", "bf16", "int8", "int4", "int2", "sign", "turboquant", "bitdp")
STEPS, H = 8, 3

#: (name, section fields): one run each, compared with the oracle
CASES = [(c, dict(compression=c)) for c in COMPRESSIONS] + [
    ("bf16 error feedback", dict(compression="bf16", error_feedback=True)),
    ("int4 offload cpu", dict(compression="int4", offload="cpu")),
    ("int4 no error feedback", dict(compression="int4", error_feedback=False)),
    ("sign no error feedback", dict(compression="sign", error_feedback=False)),
    ("streaming int4", dict(compression="int4", fragments=2, delay=1, alpha=0.5)),
    ("streaming fp32 delay 0", dict(compression="fp32", fragments=3)),
    ("plain momentum", dict(compression="int8", nesterov=False, outer_momentum=0.5, outer_lr=1.0)),
]


def cfg(**section):
    return LowBitConfig(algorithm="diloco", diloco={"sync_every": H, **section}, topology="flat")


def _oracle_kwargs(section: dict) -> dict:
    s = LowBitConfig(algorithm="diloco", diloco={"sync_every": H, **section}).diloco
    return dict(sync_every=H, compression=s.compression, error_feedback=s.uses_error_feedback, fragments=s.fragments,
                delay=s.delay, alpha=s.alpha, outer_lr=s.outer_lr, outer_momentum=s.outer_momentum,
                nesterov=s.nesterov)


def _flat_runs(rank, world):
    for name, section in CASES:
        ddp, _, sync = training.train(rank, oracle.adamw, cfg(**section), STEPS)
        nets = oracle.diloco(world, STEPS, **_oracle_kwargs(section))
        want = training.flat(nets[rank])
        got = training.flat(ddp.module)
        assert torch.equal(got, want), f"{name}: differs from the oracle by {(got - want).abs().max():.3g}"
        # bytes: what the exchange's formula says, for every sync that ran
        expected = sum(
            ex.payload_bytes(sync.section.compression, e.m, world) for e in sync._ready()
            for _ in range(sum(1 for t in range(1, STEPS + 1 - sync.section.delay) if _syncs(t, e.fragment, sync)))
        )  # (an exchange still in flight records its bytes when it completes)
        assert sync.traffic.bytes_sent == expected, (name, sync.traffic.bytes_sent, expected)
        if sync.section.delay == 0 and sync.section.fragments == 1 and STEPS % H == 0:
            training.same_on_every_rank(ddp.module)
    # every compressed form moved the weights away from the exact (fp32) outer sync's
    exact = training.flat(oracle.diloco(world, H, **_oracle_kwargs(dict(compression="fp32")))[rank])
    for c in COMPRESSIONS[1:]:
        ddp, _, _ = training.train(rank, oracle.adamw, cfg(compression=c), H)
        assert not torch.equal(training.flat(ddp.module), exact), f"{c}: nothing was compressed"


def _syncs(t, f, sync):
    from lowbit_strategy.algorithms.diloco import fragments as frag

    return frag.syncs_after(t, f, len(sync.fragments), sync.section.sync_every)


@pytest.mark.slow
def test_every_compression_and_streaming_equals_the_oracle():
    run_ranks(2, _flat_runs)


def _resume(rank, world, tmp):
    for section in (dict(compression="int4"), dict(compression="sign", fragments=2, delay=1)):
        whole, _, _ = training.train(rank, oracle.adamw, cfg(**section), 10)
        for stop in (H * 2, H * 2 + 1):  # at a round boundary, and inside a round (and with a landing in flight)
            ddp, opt, sync = training.train(rank, oracle.adamw, cfg(**section), stop)
            entry = lowbit_strategy.save_rank_states(sync, f"{tmp}/{stop}")
            weights = {k: v.clone() for k, v in ddp.module.state_dict().items()}
            optim = opt.state_dict()
            if rank == 0:  # the front ends save rank 0's weights and optimizer: the rank state carries the rest
                torch.save((weights, optim, entry), f"{tmp}/{stop}.pt")
            torch.distributed.barrier()
            weights, optim, entry = torch.load(f"{tmp}/{stop}.pt", weights_only=False)
            resumed, _, _ = training.train(rank, oracle.adamw, cfg(**section), 10, start=stop + 1,
                                           resume=(weights, optim, entry), directory=f"{tmp}/{stop}")
            assert torch.equal(training.flat(resumed.module), training.flat(whole.module)), (section, stop)


@pytest.mark.slow
def test_resume_at_and_between_round_boundaries_is_bit_for_bit(tmp_path):
    run_ranks(2, _resume, str(tmp_path))


def _hierarchical(rank, world):
    for section in (dict(compression="int4"), dict(compression="fp32", fragments=2)):
        c = cfg(**section).replace(topology="hierarchical", ranks_per_node=2)
        ddp, _, sync = training.train(rank, oracle.adamw, c, STEPS)
        assert sync.spec.world_size == 2
        nets = oracle.diloco(2, STEPS, ranks_per_node=2, **_oracle_kwargs(section))
        assert torch.equal(training.flat(ddp.module), training.flat(nets[rank // 2])), section
        assert sync.node_traffic.node_bytes_sent > 0  # the node's mean, every step


@pytest.mark.slow
def test_hierarchical_two_nodes_of_two_ranks_equals_the_oracle_over_nodes():
    run_ranks(4, _hierarchical)


def _nonfinite_and_refusals(rank, world):
    # rank 1's loss becomes inf at step 2: its pseudo-gradient is not finite; every rank skips the
    # outer step and restarts from the global weights
    ddp, _, sync = training.train(rank, oracle.adamw, cfg(compression="int4"), H, nan_at=2)
    assert sync.skipped == 1 and sync.syncs == 0
    training.same_on_every_rank(ddp.module)
    assert torch.equal(training.flat(ddp.module), training.flat(training.model()))
    for make in (lambda p: lowbit_strategy.Lion(p, lr=1e-3), lambda p: lowbit_strategy.OneBitAdam(p, lr=1e-3)):
        with pytest.raises(LowBitSetupError, match="inner optimizer"):
            training.train(rank, make, cfg(), 1)
    # more fragments than the model's 3 blocks (the embedding and two linears): refused on every rank
    from lowbit_strategy.validation import ConfigError

    with pytest.raises(ConfigError, match=r"diloco.fragments.*at most the model's 3 blocks"):
        training.train(rank, oracle.adamw, cfg(fragments=4, sync_every=8), 1)
    # accumulation (two backward passes per step): rounds count optimizer steps, not backward passes
    _, _, sync = training.train(rank, oracle.adamw, cfg(compression="int4"), 2 * H, twice=True)
    assert sync.steps == 2 * H and sync.rounds == 2


@pytest.mark.slow
def test_non_finite_round_is_skipped_and_bad_setups_are_refused_on_every_rank():
    run_ranks(2, _nonfinite_and_refusals)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("sync_every", 0, "integer >= 1"),
        ("fragments", 0, "integer >= 1"),
        ("fragments", 5, "at most sync_every"),
        ("delay", 2, "below sync_every / fragments"),
        ("outer_lr", 0, "> 0"),
        ("outer_momentum", 1.0, r"\[0, 1\)"),
        ("outer_momentum", -0.1, ">= 0"),
        ("alpha", 1.5, r"\[0, 1\]"),
        ("compression", "int3", "allowed"),
        ("offload", "disk", "allowed"),
        ("error_feedback", "maybe", "auto, true or false"),
    ],
)
def test_bad_input_names_the_field(field, value, match):
    from lowbit_strategy.validation import ConfigError

    with pytest.raises(ConfigError, match=match) as info:
        LowBitConfig(algorithm="diloco", diloco={"sync_every": 4, "fragments": 2, field: value} if field != "fragments"
                     else {"sync_every": 4, field: value})
    assert f"diloco.{field}" in str(info.value)


def test_shorthand_env_and_defaults():
    c = LowBitConfig(algorithm="diloco", sync_every=100, compression="int4")
    assert c.diloco.sync_every == 100 and c.diloco.compression == "int4" and c.diloco.uses_error_feedback
    e = LowBitConfig.from_env({"LOWBIT_ALGORITHM": "diloco", "LOWBIT_DILOCO_SYNC_EVERY": "7"})
    assert e.algorithm == "diloco" and e.diloco.sync_every == 7
    assert not LowBitConfig(algorithm="diloco", compression="fp32").diloco.uses_error_feedback


def test_fragments_take_blocks_strided_through_depth():
    from lowbit_strategy.algorithms.diloco import fragments as frag

    names = ["wte.weight", "h.0.a.weight", "h.0.b.weight", "h.1.a.weight", "h.2.a.weight", "h.3.a.weight",
             "ln_f.weight"]
    assert frag.fragment_of(names, 2) == [0, 1, 1, 0, 1, 0, 1]
    assert [t for t in range(1, 13) if frag.syncs_after(t, 1, 2, 6)] == [3, 9]
    assert [t for t in range(1, 13) if frag.syncs_after(t, 0, 2, 6)] == [6, 12]
