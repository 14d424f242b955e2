"""TurboQuant-Adam's form per bucket: which collective synchronizes a bucket's momenta
(:func:`choose_form`), from the α–β cost model's wire time plus the codec time measured on
this machine and agreed by every rank (:func:`measure_codec_seconds`), as Lion Cub's
``auto`` plans its modes. Used by :class:`~.communicator.TurboQuantCommunicator`.

The forms ("TurboQuant-Adam", Algorithm 1, and this package's two-stage form):

* ``allgather``: every rank encodes its momentum, all-gathers codes and scales and decodes
  all P payloads: ``(P−1)·N/2`` bytes per rank, and P decodes per rank;
* ``two_stage``: all-to-all of 4-bit chunks, each rank averages and re-encodes its own
  chunk, all-gather: ~N bytes per rank at any P, two encodes and three decodes of N/P-sized
  work per chunk;
* ``bf16`` / ``fp32``: DDP's mean (a ring allreduce of ``2(P−1)/P·2N`` or ``·4N`` bytes, no
  codec; ``bf16`` as torch's ``bf16_compress_hook`` computes it). On a fast link and a CPU
  whose codec costs more than the bytes it saves, this is the fastest form — and with it
  TurboQuant-Adam is AdamW on the mean gradient, so ``auto`` is never slower than DDP + AdamW
  with the same wire by more than the measurement's error. ``auto`` falls back to the one
  ``LowBitConfig.warmup_wire`` names (``bf16`` by default).
"""

from __future__ import annotations

import torch

from lowbit_strategy.codecs.turboquant import TurboQuantCodec
from lowbit_strategy.codecs.turboquant_rows import decode_rows, encode_rows
from lowbit_strategy.pricing import flat as cost_model
from lowbit_strategy.pricing.calibration import median_seconds, sample_values

#: the compressed forms ``auto`` chooses from, in tie-break order (the first of equal predictions
#: wins), before the uncompressed fallback (:func:`choose_form`'s ``fallback``)
AUTO_FORMS = ("allgather", "two_stage")
#: the uncompressed forms (DDP's mean, in that wire)
EXACT_FORMS = ("bf16", "fp32")
#: the cost model's name of each form
COST_NAME = {"allgather": "turboquant_allgather", "two_stage": "turboquant_two_stage", "bf16": "bf16", "fp32": "fp32"}


def choose_form(
    form: str,
    world_size: int,
    numel: int,
    latency_s: float,
    bandwidth_bps: float,
    codec_seconds: dict[str, float] | None = None,
    fallback: str = "bf16",
) -> str:
    """``form`` itself, or for ``"auto"`` the form of :data:`AUTO_FORMS` + ``fallback`` (the
    uncompressed mean's wire, ``LowBitConfig.warmup_wire``) with the smallest predicted time
    for a bucket of ``numel`` elements at ``world_size`` ranks: the α–β cost model's wire time
    on the link plus, when given, ``codec_seconds[form] · numel`` (this machine's local work
    per element, :func:`measure_codec_seconds`). Equal predictions pick the first
    (``allgather``: no server re-encoding; the fallback last). The wire time is not
    discounted for overlap with backward: on a CPU the codec shares the cores with backward,
    so counting it in full keeps the choice on DDP's safe side."""
    if form != "auto":
        return form
    per_element = codec_seconds or {}
    costs = {
        name: cost_model.estimate(COST_NAME[name], world_size, numel, latency_s, bandwidth_bps).seconds
        + per_element.get(name, 0.0) * numel
        for name in (*AUTO_FORMS, fallback)
    }
    return min(costs, key=costs.__getitem__)  # first of equal costs: dicts keep the candidates' order


def measure_codec_seconds(
    codec: TurboQuantCodec,
    world_size: int,
    device: torch.device | str = "cpu",
    sample: int = 1 << 18,
    repeat: int = 3,
) -> dict[str, float]:
    """This rank's local seconds per element of each form, from an encode, a decode and a
    float32 add timed on ``sample`` random values (whole rotation blocks; median of
    ``repeat``), counted as each form's collective runs them for a bucket of N elements at
    P = ``world_size``:

    * ``allgather``: the worker error add and update, one encode of N, P decodes of N and
      the P − 1 additions of the rank-ordered sum: ``enc + P·dec + (P + 2)·add``;
    * ``two_stage``: one encode of N, the server's decode of P chunks of N/P, its sum, its
      error and re-encode of N/P, the final decode of P chunks:
      ``(1 + 1/P)·enc + (2 + 1/P)·dec + 4·add``;
    * ``fp32``: the 1/P scaling: ``add`` (the allreduce's own sum is in the wire model);
    * ``bf16``: the cast with the 1/P scaling and the copy back: ``2·add``.
    """
    b = codec.block
    m = max(b, (max(1, sample) // b) * b)
    x = sample_values(1, m, device=device)  # not the global RNG: auto must not change the training
    y = sample_values(m, device=device)
    codes, scales = encode_rows(codec, x)

    def timed(fn) -> float:
        return median_seconds(fn, repeat, device) / m

    enc = timed(lambda: encode_rows(codec, x))
    dec = timed(lambda: decode_rows(codec, codes, scales, m))
    add = timed(lambda: torch.add(x.view(-1), y))
    p = world_size
    return {
        "allgather": enc + p * dec + (p + 2) * add,
        "two_stage": (1 + 1 / p) * enc + (2 + 1 / p) * dec + 4 * add,
        "bf16": 2 * add,
        "fp32": add,
    }
