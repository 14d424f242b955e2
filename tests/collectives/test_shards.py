"""ShardSpec: which part of a bucket a rank sends and how the result comes back, with the
non-finite verdict agreed by every rank that shares the bucket."""
import pytest
import torch
import torch.distributed as dist

from lowbit_strategy import LowBitConfig
from lowbit_strategy.collectives import hierarchy
from lowbit_strategy.collectives.shards import NodeShard, Whole, pad_empty, spec_for, take
from tests.distributed import run_ranks


def test_pad_empty_keeps_an_empty_part_in_its_collective():
    t = torch.ones(3)
    assert pad_empty(t) is t
    assert torch.equal(pad_empty(t[3:]), torch.zeros(1))


def _specs(rank, world_size):
    whole = Whole(None)
    assert whole.part(10) == (0, 10) and whole.world_size == 4
    part, flag = whole.restore_async(torch.ones(10), 10, flag=torch.tensor(True)).wait()
    assert torch.equal(part, torch.ones(10)) and bool(flag)
    topo = hierarchy.resolve(LowBitConfig(topology="hierarchical", ranks_per_node=2), None)
    spec = spec_for(None, topo)
    assert isinstance(spec, NodeShard) and spec.world_size == 2 and isinstance(spec_for(None, None), Whole)
    n, local = 130, rank % 2
    bucket = torch.arange(n, dtype=torch.float32) + 1000 * (rank // 2)  # the node's (identical) bucket
    lo, hi = spec.part(n)
    assert (lo, hi) == ((0, 128) if local == 0 else (128, 130)) and spec.part_length(n) == 128
    mine = take(spec, bucket)
    assert torch.equal(mine, bucket[lo:hi])
    # only local rank 1 of node 1 sees a non-finite value in its shard: every rank of that
    # node gets the verdict from the restore, the other node's ranks do not
    flag = torch.tensor(rank == 3)
    whole_bucket, agreed = spec.restore_async(mine * 2, n, flag=flag).wait()
    assert torch.equal(whole_bucket, bucket * 2)
    assert bool(agreed) == (rank // 2 == 1)
    # an empty part still takes part: one zero element
    lo, hi = spec.part(64)
    assert torch.equal(take(spec, torch.ones(64)), torch.ones(64) if local == 0 else torch.zeros(1))
    dist.barrier()


@pytest.mark.slow
def test_whole_and_node_shard_specs_on_two_nodes_of_two_ranks():
    run_ranks(4, _specs)
