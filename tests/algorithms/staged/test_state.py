"""Named, versioned bucket state: format 2 keyed by parameter names, format 1 still read,
state of other buffers not loaded (with the reason), merges that refuse per-shard state."""
import logging

import pytest
import torch
from torch import nn

from lowbit_strategy.algorithms.lion_cub.algorithm import merge_states as lion_merge
from lowbit_strategy.algorithms.onebit.communicator import OneBitState
from lowbit_strategy.algorithms.staged import state as bucket_state
from lowbit_strategy.algorithms.staged.sync import rank0_state_without_errors
from lowbit_strategy.algorithms.turboquant.communicator import TurboQuantState
from lowbit_strategy.layout import Layout, parameter_names


def _layout(rows=3):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, rows), nn.Linear(rows, 2))
    return Layout([{"params": list(net.parameters())}], bucket_numel=10, names=parameter_names(net))


def _errors(layout):
    return {k: OneBitState(torch.full((layout.numel(k),), float(i)), torch.ones(2)) for i, k in enumerate(layout.buckets)}


def test_format_2_round_trip_by_parameter_names():
    layout = _layout()
    errors = _errors(layout)
    sd = bucket_state.state_dict(errors, layout, 2, "whole over 2 ranks")
    assert sd["format"] == 2 and set(sd["buckets"]) == {layout.key_name(k) for k in layout.buckets}
    assert "1.bias,1.weight" in sd["buckets"] and set(sd["buckets"]["1.bias,1.weight"]) == {"worker", "server"}
    back = bucket_state.load_state_dict(sd, OneBitState, layout, 2, "whole over 2 ranks", "cpu", "1-bit")
    assert back.keys() == errors.keys()
    assert all(torch.equal(back[k].worker, errors[k].worker) and torch.equal(back[k].server, v.server)
               for k, v in errors.items())


def test_format_1_tuples_are_named():
    layout = _layout()
    old = {"world_size": 2, "errors": {"3,2": (torch.ones(8), torch.zeros(4), torch.ones(1))}}
    back = bucket_state.load_state_dict(old, TurboQuantState, layout, 2, "whole over 2 ranks", "cpu", "TQ")
    assert back[(3, 2)].form == "two_stage" and torch.equal(back[(3, 2)].scale, torch.ones(1))
    old["errors"]["3,2"] = (torch.ones(8), torch.zeros(0), torch.zeros(0))
    assert bucket_state.load_state_dict(old, TurboQuantState, layout, 2, "w", "cpu", "TQ")[(3, 2)].form == "allgather"


@pytest.mark.parametrize("change", ["world", "shard", "layout"])
def test_state_of_other_buffers_is_not_loaded_and_the_log_says_why(change, caplog):
    layout = _layout()
    sd = bucket_state.state_dict(_errors(layout), layout, 2, "whole over 2 ranks")
    world, shard, mine = 2, "whole over 2 ranks", layout
    if change == "world":
        world = 3
    elif change == "shard":
        shard = "node shard 0 of 2, over 2 nodes"
    else:
        mine = _layout(rows=5)
    with caplog.at_level(logging.WARNING):
        assert bucket_state.load_state_dict(sd, OneBitState, mine, world, shard, "cpu", "1-bit") == {}
    reason = {"world": "world size 2", "shard": "saved for 'whole over 2 ranks'", "layout": "another bucket layout"}
    assert reason[change] in caplog.text


def test_unknown_format_and_fields_raise():
    layout = _layout()
    sd = bucket_state.state_dict(_errors(layout), layout, 2, "w")
    with pytest.raises(ValueError, match="format 3"):
        bucket_state.load_state_dict({**sd, "format": 3}, OneBitState, layout, 2, "w", "cpu", "1-bit")
    with pytest.raises(ValueError, match=r"holds \['server', 'worker'\], expected \['form'"):
        bucket_state.load_state_dict(sd, TurboQuantState, layout, 2, "w", "cpu", "TQ")


def test_merges_refuse_state_saved_per_shard():
    full, shard = _layout().describe(), _layout(rows=5).describe()
    rank = lambda lay: {"optimizers": [{"state": {}, "errors": {"layout": lay}}]}  # noqa: E731
    assert rank0_state_without_errors([rank(full), rank(full)]) == {"optimizers": [{"state": {}, "errors": {}}]}
    with pytest.raises(ValueError, match="different shards"):
        rank0_state_without_errors([rank(full), rank(shard)])
    lion = lambda lay: {"format": 2, "layouts": [lay], "optimizers": [{0: {"exp_avg": torch.ones(2)}}]}  # noqa: E731
    assert torch.equal(lion_merge([lion(full), lion(full)])["optimizers"][0][0]["exp_avg"], torch.ones(2))
    with pytest.raises(ValueError, match="different shards"):
        lion_merge([lion(full), lion(shard)])
