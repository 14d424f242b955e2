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

import pytest
import torch
from torch import nn

import lowbit_strategy
from lowbit_strategy import Lion, LowBitConfig, OneBitAdam, OneBitLamb, TurboQuantAdamW
from tests.distributed import run_ranks
from tests.host_reads import HostReads
from tests.training import loss, model

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
    *[(f"diloco-{c}", dict(algorithm="diloco", diloco_sync_every=2, diloco_compression=c),
       lambda ps: torch.optim.AdamW(ps, lr=1e-3)) for c in ("int4", "sign")],
    *[(f"demo-{v}-{d}", dict(algorithm="demo", demo_values=v, demo_delay=d),
       lambda ps: lowbit_strategy.DeMo(ps, lr=1e-3, compression_topk=4)) for v in ("sign", "fp32") for d in (0, 1)],
]


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
                # (BitDP's and DiLoCo's step is the user's own optimizer: torch's AdamW reads its step count on
                # CPU; DiLoCo's outer sync reads once, its verdict and norm together)
                assert n <= 1 or kw["algorithm"] in ("bitdp", "diloco"), f"{name} step {step}: {n} host reads in optimizer.step(), e.g.:\n" + "\n".join(where[:3])
            assert sum(log.bytes_sent for log in sync.traffic_logs()) > 0, name
            sync.detach()


@pytest.mark.slow
def test_no_host_reads_during_backward_and_at_most_one_per_step():
    run_ranks(2, _check)


def _check_sharded(rank, world_size):
    from tests.integrations.test_sharded import CASES as SHARDED
    from tests.integrations.test_sharded import PER_NODE, _attached

    mesh = lowbit_strategy.node_mesh("cpu", LowBitConfig(ranks_per_node=PER_NODE))
    with HostReads() as reads:
        for name, (kw, make, _) in SHARDED.items():
            net, opt, _ = _attached(kw, make, mesh)
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
