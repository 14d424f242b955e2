"""Checkpoints of the first rank-state format (positional per-bucket tuples keyed by index
strings; Lion's momenta by parameter index), written by the code of commit a1f140c
(``tests/fixtures/make_format1.py``), load into today's code and training goes on bit for
bit as it did under the code that wrote them: flat over 2 ranks and 2 nodes x 2 ranks, for
1-bit Adam, 1-bit LAMB, TurboQuant (two-stage with scale EMAs, and all-gather) and Lion Cub."""
import os

import pytest
import torch

from lowbit_strategy import LowBitConfig
from tests.distributed import run_ranks
from tests.fixtures.make_format1 import CASES, LAYOUTS
from tests.training import flat, train

FIXTURE = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "format1.pt")


def _resume_all(rank, world_size, record, at, steps):
    for name, (kw, make) in CASES.items():
        saved = record[name]
        cfg = LowBitConfig(**kw, **LAYOUTS[world_size])
        resumed, _, _ = train(
            rank, make, cfg, steps, start=at + 1, resume=(saved["weights"], saved["optimizer"], saved["entry"])
        )
        assert torch.equal(flat(resumed), saved["final"][rank]), f"{name}: resumed from format 1, rank {rank}"


@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_format1_checkpoints_resume_bit_for_bit(world_size):
    fixture = torch.load(FIXTURE, weights_only=False)
    assert fixture["by_world"][world_size]["onebit_adam"]["entry"]["world_size"] == world_size
    run_ranks(world_size, _resume_all, fixture["by_world"][world_size], fixture["at"], fixture["steps"])
