"""Lion Cub's plan: which mode, lane width and code levels a bucket is synchronized with
(:class:`SyncMode`), resolved from the config, the world size and the link (:func:`resolve_mode`;
``auto`` by the α–β cost model plus the codecs' time measured on this machine,
:func:`measure_codec_seconds`). Used by :class:`~.communicator.LionCommunicator`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, cast

import torch

from lowbit_strategy import _moved
from lowbit_strategy.algorithms.lion_cub.config import LionConfig
from lowbit_strategy.codecs import bits as lanes
from lowbit_strategy.codecs import lp_quantize_levels, majority_bits, sign_bits, sign_bits_packed, signs_from_bits
from lowbit_strategy.collectives.summed import lane_for, max_levels
from lowbit_strategy.pricing import flat as cost_model
from lowbit_strategy.pricing.calibration import median_seconds, sample_values

if TYPE_CHECKING:  # the config reads the registry, which imports this module: annotations only
    from lowbit_strategy.config import LowBitConfig

#: ``auto``/``lp`` want at least this many levels per rank (codes in [-7, 7]).
AUTO_MIN_LEVELS = 7


def lion_section(config: LowBitConfig) -> LionConfig:
    """The config's Lion Cub section (the registry's ``lion`` entry has a :class:`LionConfig`)."""
    return cast(LionConfig, config.lion)


@dataclass(frozen=True)
class SyncMode:
    """The resolved synchronization: mode, lane bits and per-rank code levels."""

    mode: str
    bits: int
    levels: int = 0


def auto_candidates(config: LowBitConfig, world_size: int, momentum_sync_every: int | None = None) -> tuple[str, ...]:
    """What ``auto`` may choose, in tie-break order (the first of equal costs wins):

    * L_p codes (p from the config) at the narrowest lane that still gives every rank
      :data:`AUTO_MIN_LEVELS` levels: Lion Cub's L1 quantization, which converges like
      32-bit Lion without momentum sync (Table 2, Sec. 5.2, Fig. 8);
    * only with momentum sync (``momentum_sync_every > 0``): the ``sign`` votes and the
      ``1bit`` majority vote, which the paper pairs with periodic momentum sync to converge
      (Sec. 5.2, 6.2, Fig. 5, 8);
    * the uncompressed sum in ``LowBitConfig.warmup_wire`` (``bf16`` by default, ``fp32``):
      it sends what DDP with that wire sends, so with codec costs counted ``auto`` never
      plans anything slower than DDP + Lion with bf16 communication, nor sends more.
    """
    every = lion_section(config).momentum_sync_every if momentum_sync_every is None else momentum_sync_every
    lane = next((b for b in (8, 16, 32) if max_levels(world_size, b) >= AUTO_MIN_LEVELS), 32)
    return (f"lp{lane}",) + (("sign", "1bit") if every else ()) + (config.exact_wire,)


def resolve_mode(
    config: LowBitConfig,
    world_size: int,
    numel: int,
    codec_seconds: dict[str, float] | None = None,
    momentum_sync_every: int | None = None,
) -> SyncMode:
    """Turn the configured mode into a concrete :class:`SyncMode` for this world size.

    ``auto`` picks, among :func:`auto_candidates`, the smallest predicted time for a bucket
    of ``numel`` elements: the α–β cost model's wire time on the configured link plus, when
    given, ``codec_seconds[name]`` (the measured encode + decode time of that candidate for
    ``numel`` elements, :func:`measure_codec_seconds`). The time is not discounted for
    overlap with backward: on a CPU the codecs share the cores with backward, so only the
    wire hides, and counting it in full keeps the choice on the safe side of DDP.
    ``momentum_sync_every`` overrides the config's (the optimizer's effective setting).
    """
    lion = lion_section(config)
    mode, bits = lion.mode, lion.bits
    if mode == "auto":
        link = config.link
        costs = {
            name: cost_model.estimate(name, world_size, numel, *link).seconds + (codec_seconds or {}).get(name, 0.0)
            for name in auto_candidates(config, world_size, momentum_sync_every)
        }
        best = min(costs, key=costs.__getitem__)  # first of equal costs: dicts keep the candidates' order
        if best.startswith("lp"):
            mode, bits = "lp", int(best[2:])
        else:
            mode, bits = best, None
    if mode == "1bit":
        return SyncMode("1bit", 1)
    if mode == "sign":
        return SyncMode("sign", lane_for(world_size, 1, signed=False, lane_bits=bits).bits, 1)
    if mode == "lp":
        bits = bits or 8
        levels = max_levels(world_size, bits)
        if levels < 1:
            raise OverflowError(
                f"mode='lp' with a {bits}-bit lane cannot hold even codes in [-1, 1] summed over "
                f"{world_size} ranks; set bits to a wider lane (16 or 32)"
            )
        return SyncMode("lp", bits, levels)
    return SyncMode(mode, 32 if mode == "fp32" else 16)


def measure_codec_seconds(
    candidates: Sequence[str],
    world_size: int,
    numel: int,
    p: float,
    device: torch.device | str = "cpu",
    sample: int = 1 << 20,
    repeat: int = 3,
) -> dict[str, float]:
    """This rank's encode + decode time of each candidate for ``numel`` elements, timed on
    a sample of at most ``sample`` random values (median of ``repeat``) and scaled linearly.
    Only the local work: the same passes the collectives make around the wire (the receive
    side of P ranks decodes N values in all, whatever P)."""
    m = max(1, min(numel, sample))
    x = sample_values(m, device=device)  # not the global RNG: auto must not change the training

    def work(name: str):
        if name == "fp32":
            return torch.sign(x.clone())
        if name == "bf16":  # the cast out and back (bf16_compress_hook's), no code levels
            return torch.sign(x.to(torch.bfloat16).float())
        if name == "1bit":
            packed = sign_bits_packed(x, 1, check_nan=False)
            return signs_from_bits(majority_bits(packed.view(1, -1), 1), m)
        if name == "sign":
            spec = lane_for(world_size, 1, signed=False)
            words = lanes.pack(sign_bits(x, 1, check_nan=False), spec.bits, validate=False)
            return torch.sign(2 * lanes.unpack(words, spec.bits, m).to(torch.int32) - world_size)
        lane = int(name[2:])
        levels = max_levels(world_size, lane)
        codes = lp_quantize_levels(x, levels, p, validate=False)
        spec = lane_for(world_size, levels, lane_bits=lane)
        shifted = (
            codes.to(spec.word_dtype) + levels if spec.word_dtype != torch.uint8 else codes.to(torch.uint8).add_(levels)
        )
        words = lanes.pack(shifted, spec.bits, validate=False)
        return torch.sign(lanes.unpack(words, spec.bits, m).to(torch.int32) - levels * world_size)

    return {name: median_seconds(partial(work, name), repeat, device) * numel / m for name in candidates}


#: the warm-up's exact sum with ``LowBitConfig(warmup_wire="fp32")`` (the paper's)
WARMUP_MODE = SyncMode("fp32", 32)
#: the exact sum per ``LowBitConfig.warmup_wire``: the warm-up's, and ``auto``'s uncompressed fallback
EXACT_MODES = {"fp32": WARMUP_MODE, "bf16": SyncMode("bf16", 16)}


#: renamed in 0.3 with the module (``lion_cub.plan`` -> ``lion_cub.mode``), still served with a warning
__getattr__ = _moved.attribute_aliases(
    __name__,
    {
        "Plan": "lowbit_strategy.algorithms.lion_cub.mode.SyncMode",
        "WARMUP_PLAN": "lowbit_strategy.algorithms.lion_cub.mode.WARMUP_MODE",
    },
)
