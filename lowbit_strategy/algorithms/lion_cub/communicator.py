"""LionCommunicator: how a distributed Lion Cub synchronizes its update vectors.

The optimizer hands it the per-parameter update vectors c_i = β1·m_i + (1-β1)·g_i of this
rank; it returns the direction sign(Σ_i Q(c_i)) of Lion Cub Algorithm 1, line 4-5, for
every parameter, computed through one compressed collective per bucket:

* ``1bit``: majority vote of the signs (all-to-all + all-gather, alternating ties; a tie
  cannot be sent in one bit, so the direction is never 0);
* ``sign``: 0/1 votes summed exactly in packed lanes (Lion Cub's "4-bit": {-1,1} -> {0,1});
  a tied vote gives direction 0, exactly like sign(0) in Lion;
* ``lp``: each parameter's c_i is L_p-quantized with its own scale M_p (Eq. 1; layers differ
  by orders of magnitude, Sec. 4.1) to levels L chosen so that the sum over P ranks fits the
  lane (2·L·P <= capacity), then summed exactly (Lion Cub's "8-bit L1");
* ``fp32`` / ``bf16``: the exact sum (the uncompressed baseline).

``auto`` resolves once, at the first step, from P, the bucket size and the configured link:
see :func:`resolve_mode`. The first ``warmup_steps`` steps synchronize the exact fp32
sum. With one rank nothing is sent and the direction is sign(c), so a world of one is
plain Lion bit for bit. Zero-element tensors take no part in any collective (their
direction is the empty tensor).

It also averages momenta across ranks (selective momentum sync, Sec. 5), agrees on which
parameters have gradients and whether any rank saw a non-finite one, and can audit a step
against the full-precision direction (sign match / flip rates, Fig. 4). Every byte goes
through :mod:`lowbit_strategy.collectives` and lands in :attr:`traffic`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch

from lowbit_strategy import buckets
from lowbit_strategy.codecs import lp_quantize_levels, sign_bits
from lowbit_strategy.collectives import cost_model, full_allreduce, majority_vote, summed_allreduce, wire
from lowbit_strategy.collectives import group as g
from lowbit_strategy.collectives.summed import lane_for, max_levels
from lowbit_strategy.config import LowBitConfig

logger = logging.getLogger(__name__)

#: ``auto``/``lp`` want at least this many levels per rank (codes in [-7, 7]).
AUTO_MIN_LEVELS = 7


@dataclass(frozen=True)
class Plan:
    """The resolved synchronization: mode, lane bits and per-rank code levels."""

    mode: str
    bits: int
    levels: int = 0


def resolve_mode(config: LowBitConfig, world_size: int, numel: int) -> Plan:
    """Turn the configured mode into a concrete :class:`Plan` for this world size.

    ``auto`` minimizes the α–β cost model's predicted time for a bucket of ``numel``
    elements on the configured link, over the modes that keep convergence:

    * always eligible: L_p codes (p from the config) at the narrowest lane that still
      gives every rank :data:`AUTO_MIN_LEVELS` levels: Lion Cub's L1 quantization, which
      converges like 32-bit Lion without momentum sync (Table 2, Sec. 5.2, Fig. 8);
    * eligible only when momentum sync is configured (``momentum_sync_every > 0``): the
      ``sign`` votes and the ``1bit`` majority vote, which the paper pairs with periodic
      momentum sync to converge (Sec. 5.2, 6.2, Fig. 5, 8).

    Ties go to the lp codes (better quality at equal cost).
    """
    lion = config.lion
    mode, bits = lion.mode, lion.bits
    if mode == "auto":
        lane = next((b for b in (8, 16, 32) if max_levels(world_size, b) >= AUTO_MIN_LEVELS), 32)
        candidates = (f"lp{lane}",) + (("sign", "1bit") if lion.momentum_sync_every else ())
        link = (config.link_latency_us * 1e-6, config.link_bandwidth_gbps * 1e9)
        best = cost_model.cheapest(world_size, numel, *link, candidates=candidates)
        if best.algorithm == "1bit":
            return Plan("1bit", 1)
        mode, bits = ("lp", lane) if best.algorithm.startswith("lp") else ("sign", None)
    if mode == "1bit":
        return Plan("1bit", 1)
    if mode == "sign":
        return Plan("sign", lane_for(world_size, 1, signed=False, lane_bits=bits).bits, 1)
    if mode == "lp":
        bits = bits or 8
        levels = max_levels(world_size, bits)
        if levels < 1:
            raise OverflowError(
                f"mode='lp' with a {bits}-bit lane cannot hold even codes in [-1, 1] summed over "
                f"{world_size} ranks; set bits to a wider lane (16 or 32)"
            )
        return Plan("lp", bits, levels)
    return Plan(mode, 32 if mode == "fp32" else 16)


WARMUP_PLAN = Plan("fp32", 32)


class LionCommunicator:
    """Process group + config: synchronizes a distributed Lion's update vectors."""

    def __init__(self, config: LowBitConfig | None = None, group=None):
        self.config = LowBitConfig() if config is None else config
        if self.config.algorithm != "lion":
            raise ValueError(f"LionCommunicator needs algorithm='lion', got {self.config.algorithm!r}")
        self.group = group
        self.world_size = g.world_size(group)
        self.traffic = wire.TrafficLog()
        self.plan: Plan | None = None
        self.last_audit: dict[str, float] | None = None

    # ---- the update direction --------------------------------------------------------
    def directions(self, updates: Sequence[torch.Tensor], step: int, audit: bool = False) -> list[torch.Tensor]:
        """sign(Σ_ranks Q(c)) for each update vector ``c`` of this rank (same shapes)."""
        if self.world_size == 1:
            return [torch.sign(c) for c in updates]
        out = [torch.sign(c) for c in updates]  # zero-element ones stay as they are
        synced = [i for i, c in enumerate(updates) if c.numel()]
        if not synced:
            return out
        size = buckets.bucket_numel(self.config.bucket_size_mb)
        if self.plan is None:
            self.plan = resolve_mode(self.config, self.world_size, min(size, sum(updates[i].numel() for i in synced)))
            logger.info("lowbit: Lion Cub synchronizes with %s", self.plan)
        plan = self.plan if step > self.config.warmup_steps else WARMUP_PLAN
        audits = []
        for idx in buckets.plan([updates[i].numel() for i in synced], size):
            chunk = [updates[synced[j]] for j in idx]
            flat = self._bucket_direction(chunk, step, plan)
            if audit:
                audits.append(self._audit(chunk, flat))
            for j, d in zip(idx, buckets.unflatten(flat, chunk)):
                out[synced[j]] = d
        if audit:
            total = sum(a[2] for a in audits)
            self.last_audit = {
                "sign_match": sum(a[0] for a in audits) / total,
                "sign_flip": sum(a[1] for a in audits) / total,
            }
        return out

    def _bucket_direction(self, chunk: Sequence[torch.Tensor], step: int, plan: Plan) -> torch.Tensor:
        check = self.config.debug
        flat = buckets.flatten(chunk)
        if plan.mode == "1bit":
            return majority_vote(flat, step, self.group, check=check, validate=False, traffic=self.traffic)
        if plan.mode in ("fp32", "bf16"):
            dtype = torch.float32 if plan.mode == "fp32" else torch.bfloat16
            return torch.sign(full_allreduce(flat, self.group, wire_dtype=dtype, check=check, traffic=self.traffic))
        if plan.mode == "sign":
            codes = sign_bits(flat, step, check_nan=False)
            votes = summed_allreduce(codes, 1, self.group, signed=False, lane_bits=plan.bits,
                                     validate=False, check=check, traffic=self.traffic)
            return torch.sign(2 * votes - self.world_size).to(flat.dtype)
        codes = torch.cat([lp_quantize_levels(c.reshape(-1), plan.levels, self.config.lion.p, validate=False)
                           for c in chunk])
        sums = summed_allreduce(codes, plan.levels, self.group, lane_bits=plan.bits,
                                validate=False, check=check, traffic=self.traffic)
        return torch.sign(sums).to(flat.dtype)

    def _audit(self, chunk: Sequence[torch.Tensor], direction: torch.Tensor) -> tuple[float, float, int]:
        """Compare with the full-precision direction (Lion Cub Fig. 4): (#match, #flip, #total)."""
        exact = torch.sign(full_allreduce(buckets.flatten(chunk), self.group, traffic=wire.TrafficLog()))
        match = int((direction == exact).sum())
        flip = int(((direction == -exact) & (exact != 0)).sum())
        return match, flip, exact.numel()

    # ---- agreement and momentum --------------------------------------------------------
    def agree(self, has_grad: Sequence[bool], nonfinite: torch.Tensor | bool | None,
              device: torch.device | str = "cpu") -> tuple[list[bool], bool]:
        """Which parameters have a gradient on *any* rank, and whether any rank saw NaN/Inf.

        Gradients are local in optimizer mode, so both can differ across ranks; acting on
        a local view would make ranks enter different collectives (a hang) or diverge.
        ``device`` must be one the backend can reduce on (the parameters' device; NCCL
        needs CUDA).
        """
        flags = torch.tensor(list(has_grad) + [0], dtype=torch.int32, device=device)
        if nonfinite is not None:
            flags[-1] = torch.as_tensor(nonfinite, device=device).to(torch.int32)
        g.all_reduce_sum(flags, self.group, "lion.agree", self.traffic)
        flags = flags.tolist()
        return [f > 0 for f in flags[:-1]], flags[-1] > 0

    def average_(self, tensors: Sequence[torch.Tensor]) -> None:
        """Replace each tensor by its mean over ranks (fp32 on the wire), in place."""
        tensors = [t for t in tensors if t.numel()]
        if self.world_size == 1 or not tensors:
            return
        flat = buckets.flatten(tensors).float()
        mean = full_allreduce(flat, self.group, traffic=self.traffic) / self.world_size
        for t, v in zip(tensors, buckets.unflatten(mean, tensors)):
            t.copy_(v)
