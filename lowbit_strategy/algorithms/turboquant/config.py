"""TurboQuant-Adam's section of :class:`~lowbit_strategy.config.LowBitConfig` (``config.turboquant``).

The optimizer's hyperparameters (``lr``, ``betas``, ``bits``, ``warmup_steps``, the variance
variant, the scale EMA) are :class:`~lowbit_strategy.TurboQuantAdamW`'s constructor
arguments, as for ``torch.optim.AdamW``; the section holds only how the synchronization
runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lowbit_strategy.codecs.hadamard import check_rotation_block
from lowbit_strategy.section import Section
from lowbit_strategy.validation import ConfigError, as_bool, as_choice, as_int

#: accepted values of ``form``
FORMS = ("auto", "allgather", "two_stage", "bf16", "fp32")


@dataclass(frozen=True)
class TurboQuantConfig(Section):
    """TurboQuant-Adam (``lowbit_strategy.TurboQuantAdamW``).

    overlap: after warm-up, start each fused momentum buffer's collective from the
        communication hook, during backward (True), or synchronize in ``optimizer.step()``
        (False). Same result bit for bit. The Lightning strategy turns it off itself when
        gradients change after backward (gradient clipping), and says so once.
    form: the collective. ``allgather`` (the paper's Algorithm 1: every rank's 4-bit codes
        to every rank; ``(P-1)·N/2`` bytes per rank, 8x below a float32 ring allreduce at
        P = 2, 4x at P = 4, 2x *above* it at P = 32); ``two_stage`` (all-to-all of 4-bit
        chunks, each rank averages and re-encodes its chunk with its own error feedback,
        all-gather: ~8x below float32 at any P, one more collective's latency); ``fp32``
        (DDP's exact mean: AdamW on the mean gradient, nothing compressed); ``auto``
        (default): per bucket, the one predicted fastest from the α–β cost model on the
        configured link (``link_bandwidth_gbps``, ``link_latency_us``) plus the codec time
        measured at setup and agreed by every rank, so where encoding costs more than the
        bytes it saves it falls back to the uncompressed mean in ``LowBitConfig.warmup_wire``
        (``bf16`` by default: what DDP's ``bf16_compress_hook`` sends, never more) and is
        never slower than DDP + AdamW with that hook; equal predictions pick ``allgather``,
        then ``two_stage``. ``bf16``: torch's ``bf16_compress_hook``'s mean (AdamW on it).
    block: elements per Hadamard rotation block and per scale (a power of two; 1024, the
        codec's default, costs 4 bytes of scale per 512 bytes of codes).
    seed: seed of the rotation's random signs (the same on every rank by construction).
    """

    name: ClassVar[str] = "turboquant"
    overlap: bool = True
    form: str = "auto"
    block: int = 1024
    seed: int = 0

    def __post_init__(self) -> None:
        self._set("overlap", as_bool(self.field_name("overlap"), self.overlap))
        self._set("form", as_choice(self.field_name("form"), self.form, FORMS))
        block = as_int(self.field_name("block"), self.block, 2)
        try:
            check_rotation_block(block)
        except ValueError:
            raise ConfigError(self.field_name("block"), self.block, "a power of two in [2, 2**20]") from None
        self._set("block", block)
        self._set("seed", as_int(self.field_name("seed"), self.seed, 0, 2**63 - 1))
