"""Checkpoints of the first rank-state format (positional per-bucket tuples keyed by index
strings; Lion's momenta by parameter index), written by the code of commit a1f140c
(``tests/fixtures/make_format1.py``), load into today's code: flat over 2 ranks and 2 nodes x
2 ranks, for 1-bit Adam, 1-bit LAMB, TurboQuant (two-stage with scale EMAs, and all-gather)
and Lion Cub.

Two checks, both computed on the machine running the test (the fixture holds inputs only;
the weights training reached on the machine that wrote it are not a machine-independent
expectation: another CPU's float path ends at other bits):

- the loaded state is exactly what the format-1 tensors hold, read through the format's own
  definition (written out here, independently of the loader): each bucket's tuple in its
  fields' order, its key's parameter indices naming the bucket's parameters;
- training on from the format-1 checkpoint equals, bit for bit, training on from the same
  state saved and loaded in today's format.
"""
import os

import pytest
import torch
import torch.distributed as dist

import lowbit_strategy
from lowbit_strategy import LowBitConfig
from tests.distributed import run_ranks
from tests.fixtures.make_format1 import CASES, LAYOUTS
from tests.training import flat, model, same_on_every_rank, train

FIXTURE = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "format1.pt")

#: format 1's per-bucket tuples, field by field (the algorithm's own ``legacy_fields``)
FIELDS = {"onebit": ("worker", "server"), "turboquant": ("worker", "server", "scale")}
#: the form format 1 implied (it stored none): a server error means two-stage
FORMS = {"turboquant_two_stage": "two_stage", "turboquant_allgather": "allgather"}


def _equal_tensors(saved: dict, loaded: dict, where: str) -> None:
    assert set(saved) == set(loaded), (where, sorted(saved), sorted(loaded))
    for k, v in saved.items():
        for field, t in v.items():
            assert torch.equal(t, loaded[k][field].cpu()), f"{where}: {k}.{field}"


def _check_loaded(name: str, old: dict, now: dict, names: list[str]) -> float:
    """``now`` (today's ``sync.state_dict()`` after loading) holds exactly ``old``'s tensors;
    the sum of their magnitudes (the state carries something)."""
    total = 0.0
    for i, opt in enumerate(old["optimizers"]):
        if name == "lion":  # Lion Cub: each optimizer's momenta by parameter index
            _equal_tensors(opt, now["optimizers"][i], f"{name} optimizer {i}")
            total += sum(float(t.abs().sum()) for v in opt.values() for t in v.values())
            continue
        _equal_tensors(opt["state"], now["optimizers"][i]["state"], f"{name} optimizer {i}")
        fields = FIELDS[name.split("_")[0]]
        buckets = now["optimizers"][i]["errors"]["buckets"]
        expected = {}
        for key, values in opt["errors"]["errors"].items():
            bucket = ",".join(names[int(j)] for j in key.split(","))
            expected[bucket] = dict(zip(fields, values, strict=True))
            total += sum(float(t.abs().sum()) for t in values)
            if name in FORMS:
                assert buckets[bucket]["form"] == FORMS[name], (name, bucket, buckets[bucket]["form"])
        _equal_tensors(expected, {k: {f: v[f] for f in fields} for k, v in buckets.items()}, f"{name} errors")
    return total


def _resume_all(rank, world_size, record, at, steps):
    names = [n for n, _ in model().named_parameters()]
    for name, (kw, make) in CASES.items():
        saved = record[name]
        cfg = LowBitConfig(**kw, **LAYOUTS[world_size])
        weights, optimizer, old_entry = saved["weights"], saved["optimizer"], saved["entry"]
        # loaded, no step taken: the state is the file's
        _, _, sync = train(rank, make, cfg, at, start=at + 1, resume=(weights, optimizer, old_entry))
        carried = torch.tensor(_check_loaded(name, old_entry["states"][rank], sync.state_dict(), names))
        dist.all_reduce(carried)
        assert carried > 0, f"{name}: the checkpoint holds no error feedback or momenta to carry"
        entry = [lowbit_strategy.save_rank_states(sync)]  # today's format, gathered on rank 0
        dist.broadcast_object_list(entry, src=0)
        assert entry[0]["states"][rank]["optimizers"] is not None
        from_old, _, _ = train(rank, make, cfg, steps, start=at + 1, resume=(weights, optimizer, old_entry))
        from_new, _, _ = train(rank, make, cfg, steps, start=at + 1, resume=(weights, optimizer, entry[0]))
        assert torch.equal(flat(from_old), flat(from_new)), f"{name}: format 1 and today's format differ, rank {rank}"
        assert not torch.equal(flat(from_old), torch.cat([w.reshape(-1) for w in weights.values()])), name
        same_on_every_rank(from_old)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", sorted(LAYOUTS))
def test_format1_checkpoints_load_exactly_and_train_on_as_todays_format(world_size):
    fixture = torch.load(FIXTURE, weights_only=False)
    assert fixture["by_world"][world_size]["onebit_adam"]["entry"]["world_size"] == world_size
    run_ranks(world_size, _resume_all, fixture["by_world"][world_size], fixture["at"], fixture["steps"])
