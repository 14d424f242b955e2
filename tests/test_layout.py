"""The optimizer's Layout: slots, fixed buckets and names, sized by local tensors."""
import pytest
import torch
from torch import nn

from lowbit_strategy.layout import Layout, local_view, parameter_names
from tests.distributed import run_ranks


def _model():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    net[0].bias.requires_grad_(False)  # frozen: in the slots, in no bucket
    return net


def test_buckets_run_last_parameter_first_and_skip_frozen_and_empty():
    net = _model()
    empty = nn.Parameter(torch.zeros(0))
    groups = [{"params": list(net[0].parameters())}, {"params": [*net[1].parameters(), empty]}]
    layout = Layout(groups, bucket_numel=8, names=parameter_names(net))
    assert [s.name for s in layout.slots] == ["0.weight", "0.bias", "1.weight", "1.bias", "param4"]
    assert layout.slots[2].group is groups[1]
    # 1.bias (2), 1.weight (6) fill a bucket of 8; 0.weight (12) is alone; 0.bias frozen, param4 empty
    assert layout.buckets == [(3, 2), (0,)]
    assert layout.key_name((3, 2)) == "1.bias,1.weight" and layout.key_of_name()["0.weight"] == (0,)
    assert layout.numel((3, 2)) == 8 and layout.index_of(net[1].bias) == 3 and layout.index_of(torch.zeros(1)) is None
    assert layout.indices([net[1].weight, torch.zeros(1)]) == {2}
    assert layout.describe()["shapes"]["0.weight"] == (3, 4)


def test_a_plain_tensor_is_its_own_local_view():
    t = torch.ones(3)
    assert local_view(t) is t


def _dtensor(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    weight = distribute_tensor(torch.arange(12.0).view(6, 2), mesh, [Shard(0)])
    bias = distribute_tensor(torch.arange(3.0), mesh, [Shard(0)])  # 3 rows over 2 ranks: 2 and 1
    weight.requires_grad_(True), bias.requires_grad_(True)
    assert weight.numel() == 12  # a DTensor's numel is global
    layout = Layout([{"params": [weight, bias]}], bucket_numel=1000)
    assert torch.equal(local_view(weight), torch.arange(12.0).view(6, 2)[3 * rank : 3 * rank + 3])
    assert layout.numel(layout.buckets[0]) == (6 + 2 if rank == 0 else 6 + 1)
    assert layout.describe()["shapes"] == {"param0": (3, 2), "param1": (2 - rank,)}


@pytest.mark.slow
def test_layout_sizes_a_dtensor_by_its_local_shard():
    run_ranks(2, _dtensor)
