"""TurboQuant collectives: the rank mean of a float vector sent as TurboQuant codes.

The two synchronizations of "TurboQuant-Adam", both built on
:class:`~lowbit_strategy.codecs.turboquant.TurboQuantCodec` (``bits``-bit Lloyd–Max codes
of the Hadamard-rotated vector + one float32 scale per codec block). With P ranks, an
``n``-element vector, ``k(m)`` code bytes for ``m`` elements (``ceil(m·lane/8)``: ``m/2``
at 4 bits) and ``nb(m) = ceil(m / block)`` scales:

**All-gather form** (Algorithm 1; :func:`turboquant_allgather_mean`): every rank encodes
its whole vector, all-gathers the codes and the scales, decodes all P payloads and sums
them in rank order, then divides by P: ``mean = (d_0 + d_1 + … + d_{P−1}) / P``, the same
float32 operations on every rank, so the result is bit-identical everywhere. Bytes per
rank (sent = received): ``(P−1)·(k(n) + 4·nb(n))``: 8x below a float32 ring allreduce
(``2(P−1)/P·4n``) at P = 2, 4x at P = 4, and *more* than it past P = 16 (2x at P = 32).
No state, no error feedback (a caller may keep its own, as the paper's optimizer does).
``scale=`` is passed to the encode (the codec's rules: one value or ``nb(n)`` values;
every rank must pass the same kind, so that every rank sends as many scales).

**Two-stage form** (:func:`turboquant_two_stage_mean`): bytes ~8x below float32 at any P,
the same pattern as the error-compensated 1-bit allreduce (:mod:`.compensated`):

1. *worker*: the vector, padded with zeros, is cut into P chunks of ``c`` elements; each
   chunk is encoded on its own (a payload of ``c`` elements);
2. *all-to-all* of the codes and of the scales: rank r receives every rank's chunk r;
3. *server*: rank r decodes the P payloads, sums them in rank order and divides by P,
   adds its ``server_error`` (float32, ``c`` elements, this rank's own), encodes the
   result ``y`` again and keeps ``server_error ← y − decode(encode(y))`` (error feedback of
   the re-encoding: what this call could not deliver is sent with the next);
4. *all-gather* of the server codes and scales; every rank decodes all P chunks.

Bytes per rank: ``2·(P−1)·(k(c) + 4·nb(c))`` ≈ ``2(P−1)/P·(n/2 + 4n/block)`` at 4 bits,
1/8 of the float32 ring allreduce plus ``1/(8·block)·32`` of it for the scales.

Layout and padding (two-stage): :func:`turboquant_server_chunk_length` gives
``c = block·ceil(n / (P·block))`` when ``n ≥ P·block`` (whole codec blocks: no rotation
block or scale group straddles two chunks, and every group but the last chunk's tail is
a full one), else ``c = 8·ceil(n / (8P))`` (a vector shorter than P blocks: each chunk is
one partial block; a multiple of 8 so every code lane fills whole bytes). Rank r owns
elements ``[r·c, (r+1)·c)``; the padding (``P·c − n`` zeros, fewer than ``P·block``, so
negligible for buckets of many blocks but up to ~2x the bytes when ``n`` is just above
``P·block``) is encoded with the real elements of the last chunk(s) (a chunk of padding
only has scale 0 and decodes to zeros) and dropped at the end. The server zeroes the
padding of its mean before encoding and ``server_error``'s padding entries stay 0.

**Worker error feedback** (both forms, optional; the optimizer's momentum-level error
compensation, "TurboQuant-Adam" Algorithm 1): with ``worker_error`` (float32, ``n``
elements, this rank's own) the vector sent is ``u = x + worker_error``, and after the call
``worker_error = u − decode(encode(u))``: what this rank's codes could not carry is added to
its next call. In the all-gather form the decode is the one the mean needs anyway (this
rank's row); in the two-stage form it is one more decode of this rank's chunks, run while
the all-to-all is on the wire.

**Given scales** (both forms): ``scale=`` replaces the per-block RMS of the worker encode
(an optimizer keeping an EMA of the scale passes it): the codec's rules, for the
all-gather form ``1`` or ``nb(n)`` values; for the two-stage form ``1`` or ``P·nb(c)``
values, chunk ``r``'s groups at ``[r·nb(c), (r+1)·nb(c))`` (:func:`turboquant_scale_groups`
gives both layouts). The server's re-encoding always uses the RMS of its mean.

Arithmetic is float32 (the codec's); the result is float32 rounded to ``x``'s dtype.
With ``P = 1`` nothing is sent and the same arithmetic runs.

Non-finite input: a NaN or inf in rank i's vector gives a non-finite scale in rank i's
payload (the codec's RMS). In the all-gather form every rank sees it in
:attr:`TurboQuantAllgather.scales`; in the two-stage form it makes the server's mean
non-finite in that block, hence its server scale, and
:attr:`TurboQuantTwoStage.server_scales` (gathered, identical on every rank) is
non-finite on every rank: ``torch.isfinite(scales).all()`` is the same verdict
everywhere, an agreement on "skip this step" with no extra collective. The server error
of that block becomes non-finite too: pass a copy if a skipped step must not move it.
"""

from lowbit_strategy.collectives.turboquant.allgather import (
    TurboQuantAllgather,
    turboquant_allgather_mean,
    turboquant_allgather_mean_start,
)
from lowbit_strategy.collectives.turboquant.common import (
    rank_ordered_mean,
    turboquant_scale_groups,
    turboquant_server_chunk_length,
    turboquant_server_error,
)
from lowbit_strategy.collectives.turboquant.two_stage import (
    TurboQuantTwoStage,
    encode_chunks,
    turboquant_two_stage_mean,
    turboquant_two_stage_mean_start,
)

__all__ = [
    "TurboQuantAllgather",
    "TurboQuantTwoStage",
    "encode_chunks",
    "rank_ordered_mean",
    "turboquant_allgather_mean",
    "turboquant_allgather_mean_start",
    "turboquant_scale_groups",
    "turboquant_server_chunk_length",
    "turboquant_server_error",
    "turboquant_two_stage_mean",
    "turboquant_two_stage_mean_start",
]
