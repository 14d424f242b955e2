"""BitDP's per-rank state: BitDPState's state dict, the world-size merge, and the generic
gather/pick of :mod:`lowbit_strategy.rank_state` (Trainer-level round trips are in
tests/integrations/test_lightning.py)."""
import logging

import pytest
import torch
from torch import nn

from lowbit_strategy import BitDPState, rank_state
from lowbit_strategy.algorithms.bitdp.algorithm import merge_states


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.fc = nn.Linear(4, 6)
        self.out = nn.Linear(6, 3)


def _state(model, residuals, it=7):
    s = BitDPState(bits=2, error_feedback=True, model=model)
    by_name = {n: p for n, p in model.named_parameters()}
    s.iter = it
    s.residuals = {id(by_name[n]): r for n, r in residuals.items()}
    return s


def test_bitdp_state_round_trips_by_name_into_another_model_instance():
    torch.manual_seed(0)
    a, b = Net(), Net()
    res = {"fc.weight": torch.randn(6, 4), "out.weight": torch.randn(3, 6)}
    sd = _state(a, res).state_dict()
    assert sd["format"] == 1 and sd["iter"] == 7 and set(sd["residuals"]) == set(res)
    fresh = BitDPState(bits=2, error_feedback=True, model=b)
    fresh.load_state_dict(sd)
    assert fresh.iter == 7
    got = {fresh.params[k].name: r for k, r in fresh.residuals.items()}
    assert set(got) == set(res) and all(torch.equal(got[n], res[n]) for n in res)
    assert set(fresh.residuals) == {id(b.fc.weight), id(b.out.weight)}


@pytest.mark.parametrize("bad, match", [
    ({"iter": -1, "residuals": {}}, "'iter' must be an int >= 0"),
    ({"iter": 3, "residuals": {"nope.weight": torch.zeros(1)}}, "unknown parameter 'nope.weight'"),
    ({"iter": 3, "residuals": {"fc.weight": torch.zeros(4, 6)}}, r"shape \(4, 6\); the model's is \(6, 4\)"),
    ({"iter": 3, "residuals": {"fc.bias": torch.zeros(6)}}, "not quantized"),
    ({"format": 2, "iter": 3, "residuals": {}}, "the state has format 2; this version reads format 1"),
])
def test_bitdp_state_rejects_a_mismatched_state(bad, match):
    s = BitDPState(bits=2, model=Net())
    with pytest.raises((ValueError, KeyError), match=match):
        s.load_state_dict(bad)


def test_bitdp_state_load_needs_attach():
    with pytest.raises(RuntimeError, match="attach"):
        BitDPState(bits=1).load_state_dict({"iter": 0, "residuals": {}})


def test_same_world_size_picks_own_state_other_size_averages_with_a_warning(caplog):
    states = [{"iter": 5, "residuals": {"fc.weight": torch.full((2,), float(r))}} for r in range(3)]
    entry = {"world_size": 3, "states": states}
    assert rank_state.pick(entry, 1, 3, merge_states, "x") is states[1]
    with caplog.at_level(logging.WARNING, logger="lowbit_strategy.rank_state"):
        merged = rank_state.pick(entry, 0, 2, merge_states, "BitDP residuals")
    assert "world size 3, resuming with 2; BitDP residuals" in caplog.text
    # the mean residual carries the same untransmitted share of the mean gradient
    assert merged["iter"] == 5 and torch.equal(merged["residuals"]["fc.weight"], torch.full((2,), 1.0))


def test_single_process_gather_keeps_the_object_on_cpu():
    out = rank_state.gather({"a": torch.ones(2)})
    assert out["world_size"] == 1 and torch.equal(out["states"][0]["a"], torch.ones(2))
