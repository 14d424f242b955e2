"""BitDP's DDP hook in the two-stage form (``form="two_stage"``), its config field and
``auto``'s choice.

Under real DDP on gloo subgroups (P = 2, 3, 4; the same 4-process launch as the all-gather
hook's tests in test_hook.py): the first compressed iteration equals the collective's
single-process oracle bucket by bucket (every rank's codes, the same chunks, the same sum
order, zero server errors), replicas stay identical, the bytes equal the cost model's, the
hook makes no host read, a short AdamW run ends close to the all-gather form's, and a
resume from the hook's state dict (server errors included) continues bit for bit at P = 2
(at P >= 3 DDP's provisional buckets after a restart change the full-precision allreduce's
summation order, in both forms: close, not bit-exact).
"""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lowbit_strategy import BitDPState, ConfigError, LowBitConfig
from lowbit_strategy.algorithms.bitdp.algorithm import merge_states
from lowbit_strategy.collectives import TrafficLog
from lowbit_strategy.collectives import group as g
from lowbit_strategy.pricing.flat import bitdp_bytes
from lowbit_strategy.collectives.gathered import PayloadLayout
from tests.algorithms.bitdp.test_hook import CONV1D_TINY, QUANTIZED_TINY, TinyLM, _check_ddp, _ddp, _local_grads, _loss
from tests.collectives.test_gathered_two_stage import _oracle
from tests.distributed import SUBGROUPS, in_subgroups, run_ranks
from tests.integrations.test_host_syncs import HostReads


def _grads_after(model, ddp, rank, it):
    model.zero_grad(set_to_none=True)
    _loss(ddp, rank, it).backward()
    return {n: q.grad for n, q in model.named_parameters()}


def _identical(t, group, p, what):
    every = torch.empty(p * t.numel())
    dist.all_gather_single(every, t.contiguous(), group=group)
    assert all(torch.equal(x, t) for x in every.view(p, -1)), what


def _check_exact_bytes_and_no_host_read(base, rank, p, group):
    traffic, buckets = TrafficLog(), {}
    state = BitDPState(bits=2, process_group=group, chunk_rows=5, traffic=traffic, form="two_stage")
    model, ddp = _ddp(base, state, buckets)
    ref, names = copy.deepcopy(base), {id(q): n for n, q in model.named_parameters()}
    with HostReads() as reads:
        for it in range(4):
            traffic.clear()
            buckets.clear()
            got = reads.run("backward", lambda: _grads_after(model, ddp, rank, it))
            assert reads.take("backward")[0] == 0, "no host read inside the hook"
            if it < 2:
                continue
            _identical(torch.cat([g.reshape(-1) for g in got.values()]), group, p, "replicas must stay identical")
            mixed = [[names[i] for i in ids if names[i] in QUANTIZED_TINY] for ids in buckets.values()]
            mixed = [b for b in mixed if b]
            layouts = [PayloadLayout.of([_rows(model, n) for n in b], 2) for b in mixed]
            two = {op: n for op, n in traffic.by_op().items() if "two_stage" in op}
            assert sum(two.values()) == sum(bitdp_bytes("two_stage", lay, p) for lay in layouts)
            assert "gathered.codes.all_gather" not in traffic.by_op()
            if it == 2:  # first compressed step: server errors all zero, the oracle knows every input
                per = _local_grads(ref, p, it)
                for b in mixed:
                    mats = [[_channel_major(n, g[n]) for n in b] for g in per]
                    want, _ = _oracle(mats, 2, _zeros(mats, p))
                    mine = torch.cat([_channel_major(n, got[n]).reshape(-1) for n in b])
                    assert torch.equal(mine, want), f"bucket {b} differs from the collective's oracle"
    assert any(e.abs().sum() > 0 for e in state.server_errors.values()), "the server errors are kept"


def _zeros(mats, p):
    from lowbit_strategy.collectives.gathered_two_stage import chunking

    plan = chunking(PayloadLayout.of([tuple(m.shape) for m in mats[0]], 2), p)
    return [torch.zeros(n) for n in plan.numel]


def _channel_major(name, g):
    return g.t() if name in CONV1D_TINY else g


def _rows(model, name):
    shape = model.get_parameter(name).shape
    return (shape[1], shape[0]) if name in CONV1D_TINY else tuple(shape)


def _train(base, rank, group, form, steps, start=0, resume=None):
    state = BitDPState(bits=2, process_group=group, form=form)
    model, ddp = _ddp(base, state, {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if resume is not None:
        weights, optim, hook_state = resume
        model.load_state_dict(weights)
        opt.load_state_dict(optim)
        state.load_state_dict(hook_state)
    losses = []
    for it in range(start, steps):
        opt.zero_grad(set_to_none=True)
        out = _loss(ddp, rank, it)
        out.backward()
        opt.step()
        losses.append(out.item())
    return model, opt, state, losses


def _flat(model):
    return torch.cat([q.detach().reshape(-1) for q in model.parameters()])


def _check_training_and_resume(base, rank, p, group):
    steps = 12
    ag, _, _, ag_losses = _train(base, rank, group, "allgather", steps)
    ts, _, ts_state, ts_losses = _train(base, rank, group, "two_stage", steps)
    _identical(_flat(ts), group, p, "two-stage replicas must stay identical")
    assert ts_losses[-1] < ts_losses[0] and abs(ts_losses[-1] - ag_losses[-1]) < 0.25 * ag_losses[0], \
        (ts_losses, ag_losses)
    drift = (_flat(ts) - _flat(ag)).norm() / (_flat(ag) - _flat(base)).norm()
    assert drift < 0.5, f"two-stage run strays from the all-gather run: {drift:.3f} of the distance travelled"
    # resume after 7 steps (DDP's buckets are provisional again in the resumed run's first step)
    half, opt, state, _ = _train(base, rank, group, "two_stage", 7)
    saved = state.state_dict()
    assert set(saved["server_errors"]) <= QUANTIZED_TINY and (p == 1 or saved["server_errors"])
    resumed, _, again, _ = _train(base, rank, group, "two_stage", steps, start=7,
                                  resume=(half.state_dict(), opt.state_dict(), saved))
    assert again.server_errors.keys() == ts_state.server_errors.keys()
    if p <= 2:  # bit for bit, server errors included
        assert torch.equal(_flat(resumed), _flat(ts)), "a resume must continue bit for bit"
        assert all(torch.equal(ts_state.server_errors[n], e) for n, e in again.server_errors.items())
    else:  # DDP's first resumed step runs on provisional buckets, whose full-precision ring
        # allreduce of 3+ ranks adds in another order: the all-gather form differs there too
        torch.testing.assert_close(_flat(resumed), _flat(ts), rtol=0, atol=1e-2)


def _check_all(rank, world_size, group=None):
    torch.manual_seed(0)
    base = TinyLM()
    _check_ddp(rank, world_size, group)  # the all-gather form's checks (test_hook.py)
    _check_exact_bytes_and_no_host_read(base, rank, world_size, group)
    _check_training_and_resume(base, rank, world_size, group)


@pytest.mark.slow
def test_bitdp_hook_both_forms_in_ddp():
    """P = 2, 3, 4: DDP over gloo subgroups of one 4-process run (tests.distributed.SUBGROUPS)."""
    run_ranks(len(SUBGROUPS[-1]), in_subgroups, _check_all)


def test_form_field(tmp_path):
    assert LowBitConfig(algorithm="bitdp").bitdp.form == "auto"
    assert LowBitConfig(algorithm="bitdp", form="two_stage").bitdp.form == "two_stage"
    assert LowBitConfig.from_env({"LOWBIT_BITDP_FORM": "two_stage"}).bitdp.form == "two_stage"
    assert LowBitConfig.from_env({"LOWBIT_ALGORITHM": "bitdp", "LOWBIT_FORM": "allgather"}).bitdp.form == "allgather"
    path = tmp_path / "lowbit.yaml"
    path.write_text("algorithm: bitdp\nbitdp:\n  form: two_stage\n")
    assert LowBitConfig.from_env({"LOWBIT_CONFIG": str(path)}).bitdp.form == "two_stage"
    for bad in ("three", 2, "all_gather"):
        with pytest.raises(ConfigError, match=r"LowBitConfig\.bitdp\.form: got .*allowed: auto, allgather, two_stage"):
            LowBitConfig(bitdp_form=bad)
    with pytest.raises(ConfigError, match=r"LowBitConfig\.bitdp\.form: got 'two_stage'.*reduction: mean"):
        LowBitConfig(algorithm="bitdp", form="two_stage", reduction="paper")
    with pytest.raises(ValueError, match=r"BitDPState\.form: got 'ring'"):
        BitDPState(form="ring")
    with pytest.raises(ValueError, match=r"BitDPState\.form: got 'two_stage'.*reduction='mean'"):
        BitDPState(form="two_stage", reduction="paper")


def test_auto_picks_allgather_at_two_ranks_and_two_stage_at_many(monkeypatch):
    class Wide(nn.Module):  # 2M quantized elements: bandwidth-bound on a 1 Gbit/s link
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(1024, 1024, bias=False), nn.Linear(1024, 1024, bias=False)

    def form_at(p):  # (the world size the hook reads from its process group)
        monkeypatch.setattr(g, "world_size", lambda group=None: p)
        return BitDPState(model=Wide(), link=(50e-6, 1e9)).form_of()

    assert [form_at(p) for p in (2, 3, 4, 8, 32)] == ["allgather"] * 3 + ["two_stage"] * 2


def test_merge_for_another_world_size_restarts_server_errors():
    states = [{"iter": 9, "residuals": {}, "server_errors": {"fc.weight": torch.full((3,), float(r))}}
              for r in range(2)]
    assert merge_states(states) == {"format": 1, "iter": 9, "residuals": {}, "server_errors": {}}
    assert "server errors restart at zero" in " ".join(merge_states.__doc__.split())
