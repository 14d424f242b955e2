"""What travels to ``*_spawn`` workers inside the pickled Trainer (strategy, callbacks) carries
no tensors, so ranks never share state through torch.multiprocessing's shared memory.
(Lightning un-shares the LightningModule itself, not the Trainer's other members.)"""
import io
import pickle

import pytest
import torch

from callbacks import CommStats, DivergenceMonitor, MomentumSync
from lowbit_strategy import LowBitStrategy


class _StorageCounter(pickle.Pickler):
    """Counts the tensor storages a pickle would carry: torch.multiprocessing moves each of
    them into shared memory when a Trainer is sent to spawned ranks."""

    def __init__(self):
        super().__init__(io.BytesIO())
        self.storages = 0

    def persistent_id(self, obj):
        if isinstance(obj, (torch.UntypedStorage, torch.storage.TypedStorage)):
            self.storages += 1
        return None


def _storages(obj) -> int:
    counter = _StorageCounter()
    counter.dump(obj)
    return counter.storages


@pytest.mark.parametrize("make", [lambda: DivergenceMonitor(every=2, sign_agreement=True),
                                  lambda: CommStats(), lambda: MomentumSync(every=3),
                                  lambda: LowBitStrategy(mode="1bit"),
                                  lambda: LowBitStrategy(algorithm="bitdp", bitdp_quantize="all")])
def test_what_the_trainer_carries_pickles_without_tensors(make):
    assert _storages(make()) == 0


def test_divergence_monitor_builds_its_running_means_per_process():
    cb = DivergenceMonitor(every=1, sign_agreement=True)
    assert cb.match is None and cb.flip is None
    rank0, rank1 = pickle.loads(pickle.dumps(cb)), pickle.loads(pickle.dumps(cb))
    for c in (rank0, rank1):
        c.setup(None, None, "fit")
    rank0.match.update(0.5)
    rank0.match.update(1.0)
    rank1.match.update(0.25)
    assert float(rank0.match.compute()) == pytest.approx(0.75)
    assert float(rank1.match.compute()) == pytest.approx(0.25)
    assert _storages(DivergenceMonitor()) == 0
