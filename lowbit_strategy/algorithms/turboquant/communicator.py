"""TurboQuantCommunicator: TurboQuant-Adam's momentum synchronization, per bucket.

The optimizer hands it, per bucket of its fixed layout, this rank's locally updated momenta;
it returns the mean over ranks of their TurboQuant encodings
(:mod:`lowbit_strategy.collectives.turboquant`), with, per bucket and rank-local:

* the **worker error** ``e`` (momentum-level error compensation, "TurboQuant-Adam"
  Algorithm 1): the rank sends ``u = m_i + e`` and keeps ``e ← u − decode(encode(u))``;
* the **scale EMA** ``s`` (one float32 per codec block, in the collective's group layout,
  :func:`~lowbit_strategy.collectives.turboquant_scale_groups`): ``s ← γ·s + (1-γ)·rms(u)``,
  started from the first step's RMS so a fresh bucket is accurate at once. The RMS is
  taken before the rotation: the rotation is orthonormal on every group, so it is the RMS
  of the rotated group the codec scales. With ``γ = 0`` (the default) the codec's own RMS
  of each group is the scale and nothing is kept (an empty tensor in the state);
* the **server error** of the two-stage form (its re-encoding's error feedback).

The form (all-gather, two-stage, or DDP's ``bf16`` / ``fp32`` mean) is chosen per bucket once, by
the config (``form``) or, for ``auto``, by the α–β cost model on the configured link plus
the codec time measured at setup and agreed by every rank (:meth:`calibrate`,
:mod:`.form`). Non-finite input needs no extra
collective: a NaN/Inf in any rank's momentum makes its RMS, hence its scale EMA, non-finite;
the all-gather form shows every rank's scales to every rank, the two-stage form makes the
server scales non-finite on every rank. A skipped step leaves all three states as they
were (the base class commits them only for an applied step).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import ClassVar, cast

import torch

from lowbit_strategy.algorithms.staged import BucketCommunicator, Key
from lowbit_strategy.algorithms.staged.state import BucketState
from lowbit_strategy.algorithms.turboquant.config import FORMS
from lowbit_strategy.algorithms.turboquant.form import EXACT_FORMS, choose_form, measure_codec_seconds
from lowbit_strategy.codecs.turboquant import TurboQuantCodec
from lowbit_strategy.collectives.agreement import check_same
from lowbit_strategy.collectives.exact import ExactMean, wire_dtype_of
from lowbit_strategy.collectives.hierarchy import Topology
from lowbit_strategy.collectives.shards import ShardSpec
from lowbit_strategy.collectives.turboquant import (
    TurboQuantAllgather,
    TurboQuantTwoStage,
    turboquant_allgather_mean_start,
    turboquant_scale_groups,
    turboquant_server_error,
    turboquant_two_stage_mean_start,
)
from lowbit_strategy.pricing.calibration import agreed_slowest

logger = logging.getLogger(__name__)


def group_rms(v: torch.Tensor, padded: int, size: int) -> torch.Tensor:
    """RMS of every group of ``size`` consecutive elements of flat ``v`` zero-padded to
    ``padded`` elements (the last group partial when ``size`` does not divide ``padded``:
    its RMS over its own elements, as the codec computes it)."""
    n = v.numel()
    if padded > n:
        v = torch.cat([v, v.new_zeros(padded - n)])
    q = padded // size
    parts = []
    if q:
        parts.append(torch.linalg.vector_norm(v[: q * size].view(q, size), dim=1).div_(math.sqrt(size)))
    if padded > q * size:
        parts.append((torch.linalg.vector_norm(v[q * size :]) / math.sqrt(padded - q * size)).view(1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@dataclass
class TurboQuantState(BucketState):
    """A bucket's state (module docstring): ``worker`` error (this rank's part's length;
    empty in the ``fp32`` form), ``server`` error (two-stage form only, else empty),
    ``scale`` EMA (empty when ``scale_decay`` is 0) and the ``form`` it was kept for."""

    server: torch.Tensor
    scale: torch.Tensor
    form: str

    legacy_fields: ClassVar[tuple[str, ...]] = ("worker", "server", "scale")

    @classmethod
    def from_tuple(cls, values: tuple, device) -> TurboQuantState:
        """Format 1 stored no form: a server error means the two-stage form, a worker error
        alone the all-gather form, neither the exact ``fp32`` mean."""
        worker, server, scale = (v.to(device) for v in values)
        form = "two_stage" if server.numel() else "allgather" if worker.numel() else "fp32"
        return cls(worker, server, scale, form)


class TurboQuantCommunicator(BucketCommunicator):
    """Process group + per-bucket :class:`TurboQuantState`: synchronizes momenta as
    TurboQuant codes (module docstring)."""

    label = "TurboQuant"
    state_class = TurboQuantState

    def __init__(
        self,
        group=None,
        bucket_size_mb: float = 25.0,
        debug: bool = False,
        *,
        bits: int = 4,
        form: str = "auto",
        block: int = 1024,
        seed: int = 0,
        scale_decay: float = 0.0,
        link: tuple[float, float] = (50e-6, 1e9),
        topology: Topology | None = None,
        spec: ShardSpec | None = None,
        fallback: str = "bf16",
    ):
        if form not in FORMS:  # (the config section validates it too; this is the class's own entry)
            raise ValueError(f"TurboQuantCommunicator: form must be one of {FORMS}, got {form!r}")
        super().__init__(group, bucket_size_mb, debug, topology, spec)
        self.codec = TurboQuantCodec(bits, seed=seed, block=block)
        self.shard_align = block  # whole rotation blocks in each shard across nodes
        self.form = form
        self.scale_decay = float(scale_decay)
        self.link = link
        #: the uncompressed form ``auto`` falls back to (``LowBitConfig.warmup_wire``)
        self.fallback = fallback
        #: the form each bucket uses (chosen on its first step)
        self.forms: dict[Key, str] = {}
        #: this machine's local seconds per element of each form, agreed by every rank (:meth:`calibrate`)
        self.codec_seconds: dict[str, float] | None = None

    def calibrate(self, device: torch.device | str = "cpu") -> None:
        """Before training, on every rank (a collective): measure each form's codec time
        per element (:func:`~.plan.measure_codec_seconds`) and agree on it, so each rank (and
        each local rank's shard across nodes) plans with the same figures and picks the same
        forms: every rank measures at once and the slowest rank's figures are kept
        (:func:`~lowbit_strategy.pricing.calibration.agreed_slowest`; 4 ranks on 2 CPU
        cores measured ~2x a lone rank, and planning with a lone rank's figure chose a codec
        0.71x as fast as DDP + AdamW at 1 Gbit/s). Only for ``form="auto"``."""
        if self.form != "auto" or self.world_size == 1:
            return
        measure = lambda: measure_codec_seconds(self.codec, self.world_size, device)  # noqa: E731
        self.codec_seconds = agreed_slowest(measure, self.spec.everyone, "turboquant.calibrate", self.traffic, device)

    def plan_forms(self, layout: list[Key], numels: list[int]) -> None:
        """Choose every bucket's form at setup, from figures every rank shares (the agreed codec
        time, N, the link, the bucket's shard length), so every rank plans alike; when every
        bucket is the same uncompressed form (``bf16`` or ``fp32``), :attr:`exact`: the hook
        then averages gradients as DDP does with that wire, overlapping backward, instead of a
        mean of momenta after it."""
        for key, n in zip(layout, numels):
            size = self.spec.part_length(n, self.shard_align)
            self.form_of(key, size)
        self._set_exact([self.forms.get(key) for key in layout])

    def _set_exact(self, forms: list) -> None:
        """:attr:`exact` and :attr:`exact_wire` from the buckets' ``forms``: exact when they are
        one uncompressed form."""
        self.exact = bool(forms) and len(set(forms)) == 1 and forms[0] in EXACT_FORMS
        self.exact_wire = forms[0] if self.exact else "fp32"

    def form_of(self, key: Key, numel: int) -> str:
        form = self.forms.get(key)
        if form is None:
            form = choose_form(self.form, self.world_size, numel, *self.link, self.codec_seconds, self.fallback)
            if form not in self.forms.values():  # each form once: which, and why
                logger.info(
                    "lowbit: TurboQuant synchronizes a bucket of %d elements with form %r (configured %r; "
                    "link %.3g Gbit/s, %.0f us; codec seconds per element %s)",
                    numel,
                    form,
                    self.form,
                    self.link[1] / 1e9,
                    self.link[0] * 1e6,
                    self.codec_seconds,
                )
            self.forms[key] = form
        return form

    def load_state_dict(self, state: dict, device) -> None:
        """The saved bucket states and, under ``form="auto"``, the forms they were kept for.
        ``auto``'s plan comes from this machine's codec timing at attach, a measurement: a
        resumed run measuring anew (on a busier machine, say) could pick other forms and drop
        the saved errors of every bucket that changed, so the run would not continue as it
        would have. The saved forms are restored instead (they load only where the world
        size, shard and layout match, so they are valid here), checked equal on every rank
        of the group that exchanges them, and :attr:`exact` follows them."""
        super().load_state_dict(state, device)
        if self.form != "auto":
            return
        saved = {key: cast(TurboQuantState, s).form for key, s in self.errors.items()}
        # every rank of the group, loaded or not (a collective)
        check_same({"forms": sorted((str(k), f) for k, f in saved.items())}, self.group, "TurboQuant's saved forms")
        if not saved:
            return
        changed = {k: (self.forms.get(k), f) for k, f in saved.items() if self.forms.get(k) != f}
        if changed:
            logger.info(
                "lowbit: TurboQuant keeps the forms its checkpoint was saved with for %d bucket(s) "
                "(this run's plan would have changed them: %s)",
                len(changed),
                sorted(changed.values()),
            )
        self.forms.update(saved)
        self._set_exact(list(self.forms.values()))

    def _start_bucket(self, key: Key, flat: torch.Tensor, saved):
        n = flat.numel()
        form = self.form_of(key, n)
        if form in EXACT_FORMS:  # DDP's mean in place: no error to feed back; a saved state waits
            empty = flat.new_zeros(0)
            fresh = TurboQuantState(empty, empty, empty, form)
            mean = ExactMean(flat, self.group, f"turboquant.{form}", self.traffic, wire_dtype_of(form))
            return saved or fresh, mean
        two_stage = form == "two_stage"
        if saved is not None and cast(TurboQuantState, saved).form != form:
            saved = None  # saved under the other form
        if saved is None:
            worker = torch.zeros_like(flat)
            server = turboquant_server_error(flat, self.codec, self.group) if two_stage else flat.new_zeros(0)
            scale = None
        else:  # the step may still be skipped, and then the state must not move: the worker
            # error is only read (below), the server's and the scale EMA are copied (1/P, tiny)
            own = cast(TurboQuantState, saved)  # (state_class)
            worker, server, scale = own.worker, own.server.clone(), own.scale.clone()
        if self.scale_decay == 0:
            # each step's own RMS: the codec computes it from the rotated vector it encodes
            # anyway, so no extra pass here; nothing to keep for the next step
            scale, kept = None, flat.new_zeros(0)
        else:
            padded, size = turboquant_scale_groups(n, self.world_size, self.codec.block, two_stage)
            rms = group_rms(worker + flat, padded, size)
            if scale is None or scale.numel() != rms.numel():
                scale = rms
            else:
                scale = scale.mul_(self.scale_decay).add_(rms, alpha=1 - self.scale_decay)
            kept = scale
        # u = x + e is symmetric: the committed worker error goes in as the vector and the
        # buffer holding this step's momenta as the error buffer, which the collective
        # overwrites with the new error (the same floats); nothing committed is written
        handle: TurboQuantTwoStage | TurboQuantAllgather
        if two_stage:
            handle = turboquant_two_stage_mean_start(
                worker,
                self.codec,
                server,
                self.group,
                scale=scale,
                worker_error=flat,
                check=self.debug,
                traffic=self.traffic,
            )
        else:
            handle = turboquant_allgather_mean_start(
                worker, self.codec, self.group, scale=scale, worker_error=flat, check=self.debug, traffic=self.traffic
            )
        return TurboQuantState(flat, server, kept, form), handle

    def _released(self, key, state):
        if state.worker.numel():  # the worker error: ``flat``'s length (empty in the fp32 form)
            self._spare[key] = state.worker
