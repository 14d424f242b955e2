"""No host synchronization during backward, at most one per optimizer step, for every
algorithm (2 gloo ranks, plain DDP front end; the step of this package's optimizers: BitDP
runs under the user's own optimizer).

On CUDA a host read of a tensor (``item``, ``bool(t)``, ``tolist``, ``nonzero``, ``.cpu()``,
...) waits for every kernel queued before it: inside the DDP hook it would drain the GPU
queue once per bucket and serialize communication with compute. There is no GPU here, so
the reads are counted where they start: the Python entry points of ``torch.Tensor`` (and
``torch.nonzero``) are wrapped for the duration of the test, and every call made while
``loss.backward()`` runs (DDP's hooks, and the callbacks chained from their collectives) or
while ``optimizer.step()`` runs is counted.
"""

import threading
import traceback

import pytest
import torch
from torch import nn

import lowbit_strategy
from lowbit_strategy import Lion, LowBitConfig, OneBitAdam, OneBitLamb, TurboQuantAdamW
from tests.distributed import run_ranks
from tests.training import loss, model

#: torch.Tensor methods that read a tensor's value on the host
READS = ("__bool__", "__int__", "__float__", "__index__", "item", "tolist", "numpy", "nonzero", "cpu")
STEPS = 5

#: (name, LowBitConfig keyword arguments, optimizer factory): every registered algorithm,
#: Lion Cub in each mode, BitDP at 1 and 2 bits, TurboQuant in both forms; warm-up covered
CASES = [
    *[(f"lion-{m}", dict(algorithm="lion", mode=m, bucket_size_mb=0.0005, warmup_steps=1),
       lambda ps: Lion(ps, lr=1e-3)) for m in ("1bit", "sign", "lp", "fp32", "bf16")],
    *[(f"bitdp-{b}", dict(algorithm="bitdp", bitdp_bits=b, bucket_size_mb=0.0005, warmup_steps=1),
       lambda ps: torch.optim.AdamW(ps, lr=1e-3)) for b in (1, 2)],
    ("onebit_adam", dict(algorithm="onebit_adam", bucket_size_mb=0.0005),
     lambda ps: OneBitAdam(ps, lr=1e-3, freeze_step=2)),
    ("onebit_lamb", dict(algorithm="onebit_lamb", bucket_size_mb=0.0005),
     lambda ps: OneBitLamb(ps, lr=1e-3, freeze_step=2)),
    *[(f"turboquant-{f}", dict(algorithm="turboquant", turboquant_form=f, turboquant_block=16, bucket_size_mb=0.0005),
       lambda ps: TurboQuantAdamW(ps, lr=1e-3, warmup_steps=2)) for f in ("allgather", "two_stage")],
]


class HostReads:
    """Counts calls of :data:`READS` (and ``torch.nonzero``) made while a phase is open."""

    def __init__(self):
        self.phase: str | None = None
        self.counts: dict[str, int] = {}
        self.where: dict[str, list[str]] = {}
        self._lock = threading.Lock()
        self._saved = {}

    def _wrap(self, orig):
        def counted(*args, **kwargs):
            phase = self.phase
            if phase is not None:
                with self._lock:
                    self.counts[phase] = self.counts.get(phase, 0) + 1
                    self.where.setdefault(phase, []).append("".join(traceback.format_stack(limit=6)[:-1]))
            return orig(*args, **kwargs)

        return counted

    def __enter__(self):
        for name in READS:
            self._saved[(torch.Tensor, name)] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name)))
        self._saved[(torch, "nonzero")] = torch.nonzero
        torch.nonzero = self._wrap(torch.nonzero)
        return self

    def __exit__(self, *exc):
        for (owner, name), orig in self._saved.items():
            setattr(owner, name, orig)

    def run(self, phase: str, fn):
        self.phase = phase
        try:
            return fn()
        finally:
            self.phase = None

    def take(self, phase: str) -> tuple[int, list[str]]:
        with self._lock:
            return self.counts.pop(phase, 0), self.where.pop(phase, [])


def _check(rank, world_size):
    torch.manual_seed(0)
    with HostReads() as reads:
        reads.run("probe", lambda: bool(torch.ones(())))  # the counter counts
        assert reads.take("probe")[0] == 1
        for name, kw, make in CASES:
            ddp = nn.parallel.DistributedDataParallel(model())
            opt = make(ddp.parameters())
            sync = lowbit_strategy.attach(ddp, [opt], LowBitConfig(**kw))
            for step in range(1, STEPS + 1):
                opt.zero_grad()
                out = loss(ddp, rank, step)
                reads.run("backward", out.backward)
                reads.run("step", opt.step)
                n, where = reads.take("backward")
                assert n == 0, f"{name} step {step}: {n} host reads during backward, first at:\n{where[0]}"
                n, where = reads.take("step")
                # (BitDP's step is the user's own optimizer: torch's AdamW reads its step count on CPU)
                assert n <= 1 or kw["algorithm"] == "bitdp", f"{name} step {step}: {n} host reads in optimizer.step(), e.g.:\n" + "\n".join(where[:3])
            assert sum(log.bytes_sent for log in sync.traffic_logs()) > 0, name
            sync.detach()


@pytest.mark.slow
def test_no_host_reads_during_backward_and_at_most_one_per_step():
    run_ranks(2, _check)


def _check_sharded(rank, world_size):
    from tests.integrations.test_sharded import CASES as SHARDED, PER_NODE, _sharded_model

    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=PER_NODE))
    with HostReads() as reads:
        for name, (kw, make, _) in SHARDED.items():
            net = _sharded_model(mesh)
            opt = make(net.parameters())
            lowbit_strategy.attach_sharded(net, [opt], LowBitConfig(**kw, ranks_per_node=PER_NODE), mesh=mesh)
            for step in range(1, STEPS + 1):
                opt.zero_grad()
                out = loss(net, rank, step)
                reads.run("backward", out.backward)  # FSDP's hooks and the warm-up's cross-node mean
                opt.step()
                n, where = reads.take("backward")
                assert n == 0, f"sharded {name} step {step}: {n} host reads during backward, first at:\n{where[0]}"


@pytest.mark.slow
def test_sharded_path_reads_nothing_on_the_host_during_backward():
    run_ranks(4, _check_sharded)
