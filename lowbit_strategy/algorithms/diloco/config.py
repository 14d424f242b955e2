"""DiLoCo's section of :class:`~lowbit_strategy.config.LowBitConfig` (``config.diloco``).

Local updates: every worker takes ``sync_every`` optimizer steps with its own inner
optimizer, then the workers average their pseudo-gradients (global − local weights),
compressed, and an outer Nesterov SGD applies the mean ("DiLoCo: Distributed Low-Communication
Training of Language Models", Douillard et al., arXiv:2311.08105, Algorithm 1). With
``fragments > 1`` the model's blocks sync at staggered steps and each exchange may overlap
``delay`` inner steps ("Streaming DiLoCo with overlapping communication", arXiv:2501.18512,
Sec. 2.2-2.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lowbit_strategy.section import Section
from lowbit_strategy.validation import ConfigError, as_bool, as_choice, as_float, as_int, is_none

#: the values of ``compression`` -> bits per element on the wire (before scales)
COMPRESSIONS = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4, "int2": 2, "sign": 1, "turboquant": 4, "bitdp": 2}
#: the values of ``offload``
OFFLOADS = ("none", "cpu")


@dataclass(frozen=True)
class DiLoCoConfig(Section):
    """DiLoCo and Streaming DiLoCo: local updates, a compressed outer sync.

    sync_every: H, the inner optimizer steps of one round (counted from 1; gradient
        accumulation counts optimizer steps, not micro-batches).
    outer_lr: the outer SGD's learning rate (0.7, DiLoCo's; constant: the inner schedule decays).
    outer_momentum: its momentum (0.9), in [0, 1).
    nesterov: Nesterov momentum (DiLoCo's outer optimizer), as ``torch.optim.SGD`` computes it.
    compression: how the pseudo-gradient crosses the link: ``fp32`` (what torchft- and
        PRIME-style DiLoCo send), ``bf16``, ``int8`` / ``int4`` / ``int2`` (blocks of 256 with
        one scale, the project's blockwise codec, all-gathered), ``sign`` (1-bit scaled signs,
        the error-compensated allreduce of 1-bit Adam), ``turboquant`` (4-bit rotated
        Lloyd–Max codes), ``bitdp`` (BitDP's 2-bit channel codes over rows of 256).
    error_feedback: carry what the codes missed into the next round's pseudo-gradient;
        ``auto`` (default): on for 4 bits and fewer.
    fragments: F. 1 is DiLoCo; F > 1 is Streaming DiLoCo: the model's blocks (its repeated
        layers, strided through depth) form F fragments, fragment f syncs after the steps
        t with ``(t + f·H // F) % H == 0``.
    delay: τ, inner steps a fragment's exchange may run behind: launched after step t, its
        mean is applied after step t + τ (0: at once). Must be below ``sync_every / fragments``.
    alpha: with ``delay > 0``, the weight of the local weights when the outer result lands:
        ``local ← alpha·local + (1 − alpha)·global`` (Streaming DiLoCo's mixing factor; its
        0.5). With ``delay = 0`` the workers take the global weights, identical replicas.
    offload: where the global copy, the outer momentum and the error buffers live: ``none``
        (the parameters' device) or ``cpu``.
    """

    name: ClassVar[str] = "diloco"

    sync_every: int = 100
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    compression: str = "int4"
    error_feedback: bool | str = "auto"
    fragments: int = 1
    delay: int = 0
    alpha: float = 0.5
    offload: str = "none"

    def __post_init__(self) -> None:
        f = self.field_name
        self._set("sync_every", as_int(f("sync_every"), 100 if is_none(self.sync_every) else self.sync_every, 1))
        self._set("outer_lr", as_float(f("outer_lr"), self.outer_lr, positive=True))
        momentum = as_float(f("outer_momentum"), self.outer_momentum, positive=False)
        if momentum >= 1:
            raise ConfigError(f("outer_momentum"), self.outer_momentum, "expected a number in [0, 1) (DiLoCo: 0.9)")
        self._set("outer_momentum", momentum)
        self._set("nesterov", as_bool(f("nesterov"), self.nesterov))
        self._set("compression", as_choice(f("compression"), self.compression, tuple(COMPRESSIONS)))
        ef = self.error_feedback
        if isinstance(ef, str) and ef.strip().lower() == "auto":
            self._set("error_feedback", "auto")
        else:
            try:
                self._set("error_feedback", as_bool(f("error_feedback"), ef))
            except ConfigError:
                raise ConfigError(f("error_feedback"), ef, "expected auto, true or false") from None
        self._set("fragments", as_int(f("fragments"), self.fragments, 1))
        self._set("delay", as_int(f("delay"), self.delay, 0))
        if self.fragments > self.sync_every:
            raise ConfigError(
                f("fragments"), self.fragments, f"at most sync_every ({self.sync_every}): one fragment per step"
            )
        if self.delay > 0 and self.delay * self.fragments >= self.sync_every:
            raise ConfigError(
                f("delay"),
                self.delay,
                f"below sync_every / fragments = {self.sync_every / self.fragments:g}, so one fragment's "
                "exchange lands before the next one starts; lower delay or fragments, or raise sync_every",
            )
        alpha = as_float(f("alpha"), self.alpha, positive=False)
        if alpha > 1:
            raise ConfigError(f("alpha"), self.alpha, "expected a number in [0, 1] (the local weights' share)")
        self._set("alpha", alpha)
        self._set("offload", as_choice(f("offload"), self.offload, OFFLOADS))

    @property
    def bits(self) -> int:
        """Bits per element of the pseudo-gradient on the wire (scales aside)."""
        return COMPRESSIONS[self.compression]

    @property
    def uses_error_feedback(self) -> bool:
        """``error_feedback``, with ``auto`` resolved: on for 4 bits and fewer."""
        return self.bits <= 4 if self.error_feedback == "auto" else bool(self.error_feedback)
