"""A training harness shared by the distributed optimizer tests: the small model and data
every rank can rebuild (:mod:`tests.algorithms.lion_cub.test_optimizer`), a DDP training loop
through the plain-DDP front end with resume, NaN injection and a per-step probe, and the
checks every algorithm's test makes (replicas identical, the warm-up's DDP + AdamW reference).

Run inside :func:`tests.distributed.run_ranks` workers (a gloo process group is up).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import lowbit_strategy


def model(seed: int = 0) -> nn.Module:
    """A small model with an embedding, two linears and a ReLU, the same on every rank."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 5))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: 4 sequences of 3 tokens and their labels."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 20, (4, 3), generator=gen), torch.randint(0, 5, (4,), generator=gen)


def loss(net: nn.Module, rank: int, step: int) -> torch.Tensor:
    """The cross-entropy of rank ``rank``'s batch at ``step`` (every process can rebuild it)."""
    x, y = batch(rank, step)
    return nn.functional.cross_entropy(net(x), y)


def train(rank: int, make_optimizer: Callable, cfg, steps: int, *, start: int = 1, resume=None, nan_at=None,
          after_step=None, dtype=torch.float32, twice: bool = False, directory=None):
    """``(ddp model, optimizer, sync)`` after ``steps`` steps of ``make_optimizer(params)``
    under ``cfg`` (:func:`lowbit_strategy.attach`).

    ``resume = (weights, optimizer state, rank-state entry)`` loaded before step ``start``;
    ``nan_at``: the step at which rank 1's loss becomes inf; ``after_step(step, ddp, opt)``
    runs after every step; ``twice``: a second backward before each step (accumulation
    without ``no_sync``: DDP's hooks run again and the second gradient counts); ``directory``:
    where :func:`lowbit_strategy.save_rank_states` wrote the per-rank files of ``resume``'s entry."""
    ddp = nn.parallel.DistributedDataParallel(model().to(dtype))
    opt = make_optimizer(ddp.parameters())
    sync = lowbit_strategy.attach(ddp, [opt], cfg)
    if resume is not None:
        weights, optim, entry = resume
        ddp.module.load_state_dict(weights)
        opt.load_state_dict(optim)
        lowbit_strategy.load_rank_states(sync, entry, directory)
    for step in range(start, steps + 1):
        opt.zero_grad()
        out = loss(ddp, rank, step)
        if nan_at == step and rank == 1:  # an overflow in rank 1's backward
            out = out * float("inf")
        out.backward()
        if twice:
            loss(ddp, rank, step + 100).backward()
        opt.step()
        if after_step is not None:
            after_step(step, ddp, opt)
    return ddp, opt, sync


def every_rank(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` of every rank, in rank order."""
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t.contiguous())
    return every


def flat(net: nn.Module) -> torch.Tensor:
    """Every parameter of ``net``, flattened into one tensor."""
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def same_on_every_rank(net: nn.Module) -> None:
    every = every_rank(flat(net))
    assert all(torch.equal(every[0], e) for e in every[1:]), "replicas differ"


def bf16_hook(state, bucket):
    """torch's own ``bf16_compress_hook``, unmodified, under another name: DDP refuses that
    hook by its name outside NCCL/XCCL, while gloo reduces bf16 correctly."""
    return default_hooks.bf16_compress_hook(state, bucket)


def ddp_adamw(
    rank: int, steps: int, *, lr: float, betas, eps: float, weight_decay: float, wire: str = "bf16"
) -> nn.Module:
    """DDP + ``torch.optim.AdamW`` for ``steps`` steps on the same data: the reference the
    staged optimizers' warm-up must equal bit for bit. ``wire``: DDP's gradient exchange, as
    ``LowBitConfig.warmup_wire`` names it: ``bf16`` (the default) with torch's own
    ``bf16_compress_hook``, ``fp32`` without a hook."""
    ddp = nn.parallel.DistributedDataParallel(model())
    if wire == "bf16":
        ddp.register_comm_hook(None, bf16_hook)
    return _adamw_steps(ddp, rank, steps, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _adamw_steps(ddp: nn.Module, rank: int, steps: int, **adamw) -> nn.Module:
    """``steps`` steps of ``torch.optim.AdamW(**adamw)`` (per-tensor form) on ``ddp``."""
    ref = torch.optim.AdamW(ddp.parameters(), foreach=False, **adamw)
    for step in range(1, steps + 1):
        ref.zero_grad()
        loss(ddp, rank, step).backward()
        ref.step()
    return ddp


def ddp_bitdp_adamw(rank: int, steps: int, *, lr: float, betas, eps: float, weight_decay: float):
    """``(model, bytes sent)``: DDP with BitDP's own hook (2 bits, error feedback, bf16 for its
    first two steps and for what it does not code) + ``torch.optim.AdamW`` for ``steps`` steps:
    what the staged optimizers' warm-up with ``LowBitConfig(warmup_wire="int2")`` must equal."""
    from lowbit_strategy import BitDPState, bitdp_hook
    from lowbit_strategy.collectives.wire import TrafficLog

    ddp = nn.parallel.DistributedDataParallel(model())
    state = BitDPState(bits=2, error_feedback=True, warmup_wire="bf16", full_wire="bf16", model=ddp.module,
                       traffic=TrafficLog())
    ddp.register_comm_hook(state, bitdp_hook)
    return _adamw_steps(ddp, rank, steps, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay), state.traffic.bytes_sent
