"""The codec work of each algorithm on one vector, as parts 2 and 4 time it: the calls the
collectives make, with the arguments they pass, split into what a rank does before the wire
(``encode``), what a server does with the P rows it gathered (``server``: its chunk of ``n/P``
elements from each of P ranks) and what every rank does after the wire (``decode``).

Shared by :mod:`.codec_speed` (flat vectors of 2^24 and 2^26 elements, P = 4) and
:mod:`.where_time` (a GPT's real buckets, P = 8), so both time the same calls. What each
builder mirrors:

* :func:`lion_lp`: Lion Cub's L1 codes in packed lanes
  (:func:`lowbit_strategy.algorithms.lion_cub.mode.measure_codec_seconds`' ``lp`` work split
  in two), each of the bucket's update vectors with its own scale as the communicator codes
  them (``parts``); the lanes are summed by the allreduce itself, so there is no server;
* :func:`lion_1bit`: the 1-bit majority vote (:mod:`lowbit_strategy.collectives.majority`):
  sign bits packed, the server's vote count on P packed rows, the signs unpacked;
* :func:`compensated`: 1-bit Adam/LAMB's scaled signs (:mod:`~lowbit_strategy.collectives.
  compensated`, ``scale_block`` 32768): worker compress into P chunks, the server's mean of P
  decoded chunks and re-compress with its error, every rank's decode of the P server chunks;
* :func:`bitdp`: BitDP's 2-bit channel codes in the two-stage form (:mod:`~lowbit_strategy.
  collectives.gathered_two_stage`): encode + pack per matrix, the server's decode-reduce of P
  rows of its chunk and re-encode (with the decode its error needs), the final decode;
* :func:`turboquant`: TurboQuant 4-bit in the two-stage form (:mod:`~lowbit_strategy.
  collectives.turboquant.two_stage`): P chunks encoded at once, the server's rank-ordered
  mean + re-encode + decode for its error, every rank's decode of the P server chunks;
* :func:`blockwise`: the quantized FSDP reduce-scatter's int8/int4/int2 blocks (no server:
  its receivers decode and :func:`~lowbit_strategy.codecs.reduce.rank_sum`, timed apart).

The server rows are built from the worker's own output (valid codes, real scales), tiled to
P rows: the bytes a server reads are what it would get, only not from P different ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

#: 1-bit Adam/LAMB's default ``scale_block`` (``OneBitConfig.scale_block``)
ONEBIT_BLOCK = 32768


@dataclasses.dataclass
class Work:
    """One codec's calls on one vector; ``None``: the algorithm has no such step."""

    encode: Callable[[], object] | None = None
    decode: Callable[[], object] | None = None
    server: Callable[[], object] | None = None


def lion_lp(x: torch.Tensor, p: int, lane: int = 8, parts: Sequence[int] | None = None) -> Work:
    """``parts``: the sizes of the bucket's update vectors, each quantized with its own scale
    as Lion Cub's communicator does (:func:`~lowbit_strategy.codecs.lp.lp_quantize_many`);
    None: ``x`` as one vector."""
    from lowbit_strategy.codecs import bits as lanes
    from lowbit_strategy.codecs import lp_quantize_many
    from lowbit_strategy.collectives.summed import lane_for, max_levels

    n, levels = x.numel(), max_levels(p, lane)
    spec = lane_for(p, levels, lane_bits=lane)
    vectors = list(torch.split(x, list(parts))) if parts else [x]

    def encode():
        codes = lp_quantize_many(vectors, levels, 1.0)
        if spec.word_dtype == torch.uint8:
            shifted = codes.to(torch.uint8).add_(levels)
        else:
            shifted = codes.to(spec.word_dtype) + levels
        return lanes.pack(shifted, spec.bits, validate=False)

    words = encode()
    return Work(encode, lambda: torch.sign(lanes.unpack(words, spec.bits, n).to(torch.int32) - levels * p))


def lion_1bit(x: torch.Tensor, p: int) -> Work:
    from lowbit_strategy.codecs import majority_bits, sign_bits_packed, signs_from_bits
    from lowbit_strategy.collectives.majority import chunk_bytes

    n, c = x.numel(), chunk_bytes(x.numel(), p)
    packed = sign_bits_packed(x, 1, check_nan=False)
    rows = torch.zeros(p * c, dtype=torch.uint8, device=x.device)
    rows[: packed.numel()] = packed
    chunk = rows[:c].repeat(p, 1)  # P senders' votes on this rank's chunk
    return Work(
        lambda: sign_bits_packed(x, 1, check_nan=False),
        lambda: signs_from_bits(rows, n),
        lambda: majority_bits(chunk, 1),
    )


def compensated(x: torch.Tensor, p: int, block: int = ONEBIT_BLOCK) -> Work:
    from lowbit_strategy.codecs import scaled_sign_compress, scaled_sign_decode, scaled_sign_mean
    from lowbit_strategy.collectives.majority import chunk_bytes

    n, c = x.numel(), chunk_bytes(x.numel(), p)
    worker_error = torch.zeros(n, dtype=torch.float32, device=x.device)
    server_error = torch.zeros(8 * c, dtype=torch.float32, device=x.device)

    def encode():
        return scaled_sign_compress(x, worker_error, nbytes=p * c, block=block, chunk=8 * c)

    bits, scales = encode()
    got = bits.view(p, c)[:1].repeat(p, 1)  # P senders' signs of this rank's chunk
    got_scales = scales.view(p, -1)[:1].repeat(p, 1)

    def server():
        mean = scaled_sign_mean(got, got_scales, block)
        return scaled_sign_compress(mean, server_error, nbytes=c, block=block, chunk=8 * c)

    return Work(encode, lambda: scaled_sign_decode(bits.view(p, c), scales.view(p, -1), n, torch.float32, block),
                server)


def matrices(x: torch.Tensor, shapes: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Views of ``x`` (flat) as consecutive matrices of ``shapes``."""
    out, at = [], 0
    for r, c in shapes:
        out.append(x[at : at + r * c].view(r, c))
        at += r * c
    return out


def bitdp(mats: Sequence[torch.Tensor], p: int, bits: int = 2) -> Work:
    """BitDP's two-stage form on the quantized matrices ``mats`` of a bucket (the others
    travel in float32 with no codec)."""
    from lowbit_strategy.codecs import channel_encode_many
    from lowbit_strategy.collectives.gathered import PayloadLayout, decode_reduce, pack_payload
    from lowbit_strategy.collectives.gathered_two_stage import chunking

    layout = PayloadLayout.of([tuple(m.shape) for m in mats], bits)

    def encode():  # as the hook's _encode (without error feedback)
        enc = channel_encode_many(mats, bits, validate=False)
        return pack_payload([c for c, _, _ in enc], [s for _, s, _ in enc], layout)

    words, scales = encode()
    mine = chunking(layout, p).chunk_layout(0)
    server = None
    if mine is not None:
        got_words, got_scales = words[: mine.words].repeat(p, 1), scales[: mine.rows].repeat(p, 1)

        def server():  # as gathered_two_stage's _server
            y = decode_reduce(got_words, got_scales, mine)
            views = [y[e : e + r * c].view(r, c) for e, (r, c) in zip(mine.elem_offsets, mine.shapes)]
            enc = channel_encode_many(views, bits, decode=True, validate=False)
            packed = pack_payload([c for c, _, _ in enc], [s for _, s, _ in enc], mine)
            return packed, y.sub_(torch.cat([d.reshape(-1) for _, _, d in enc if d is not None]))

    return Work(encode, lambda: decode_reduce(words.view(1, -1), scales.view(1, -1), layout), server)


def turboquant(x: torch.Tensor, p: int, backend: str = "auto") -> Work:
    from lowbit_strategy.codecs import TurboQuantCodec
    from lowbit_strategy.codecs.turboquant_rows import decode_rows, encode_rows
    from lowbit_strategy.collectives.turboquant.common import rank_ordered_mean, turboquant_server_chunk_length

    codec = TurboQuantCodec(4, seed=0, block=1024, backend=backend)
    n = x.numel()
    c = turboquant_server_chunk_length(n, p, codec.block)
    server_error = torch.zeros(c, dtype=torch.float32, device=x.device)

    def encode():  # _encode_chunk_rows: zero-padded to P chunks, every chunk at once
        buf = torch.zeros(p * c, dtype=torch.float32, device=x.device)
        buf[:n] = x
        return encode_rows(codec, buf.view(p, c))

    codes, scales = encode()
    got_codes, got_scales = codes[:1].repeat(p, 1), scales[:1].repeat(p, 1)

    def server():
        mean = rank_ordered_mean(codec, got_codes, got_scales, c).add_(server_error)
        payload = codec.encode(mean)
        return payload, mean.sub_(codec.decode(payload))

    return Work(encode, lambda: decode_rows(codec, codes, scales, c), server)


def turboquant_plain(x: torch.Tensor, backend: str) -> Work:
    """The bare codec (``TurboQuantCodec.encode``/``decode`` of one vector) with ``backend``."""
    from lowbit_strategy.codecs import TurboQuantCodec

    codec = TurboQuantCodec(4, seed=0, block=1024, backend=backend)
    payload = codec.encode(x)
    return Work(lambda: codec.encode(x), lambda: codec.decode(payload))


def blockwise(x: torch.Tensor, bits: int) -> Work:
    from lowbit_strategy.codecs import blockwise as bw

    rows, n = x.view(1, -1), x.numel()
    codes, scales = bw.encode(rows, bits)
    return Work(lambda: bw.encode(rows, bits), lambda: bw.decode(codes, scales, bits, n))


def demo(x: torch.Tensor, p: int, topk: int = 32) -> Work:
    """DeMo's codec on ``x`` read as rows of 1024 (64 x 64 chunks): encode (transform, top-k,
    pack, the sent part decoded) and the mean of P workers' payloads, decoded."""
    from lowbit_strategy.codecs.topk import TopKCodec

    m = x.view(-1, 1024)
    codec = TopKCodec([tuple(m.shape)], 64, topk, "sign", x.device)
    payload = codec.encode([m])[0]
    gathered = payload.repeat(p, 1)
    return Work(lambda: codec.encode([m]), lambda: codec.mean(gathered, [m]))


def rank_sum(x: torch.Tensor, p: int) -> Work:
    """The receivers' sum of P decoded float32 rows (:func:`~lowbit_strategy.codecs.reduce.
    rank_sum`), as a server step: ``x`` cut into P rows of ``n/P``."""
    from lowbit_strategy.codecs.reduce import rank_sum as rs

    rows = x[: x.numel() // p * p].view(p, -1)
    return Work(server=lambda: rs(rows))


def tensors(out) -> list[torch.Tensor]:
    """Every tensor in a codec's output (tuples, lists, payloads), in order: for bit checks."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in tensors(o)]
    if dataclasses.is_dataclass(out):
        return [t for f in dataclasses.fields(out) for t in tensors(getattr(out, f.name))]
    return []


def _raw(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (floats compared by bits: NaN equals NaN, -0.0 differs from 0.0)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.is_floating_point() else t


def bit_equal(a, b) -> bool:
    """Whether two codec outputs hold the same tensors bit for bit."""
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(
        x.shape == y.shape and x.dtype == y.dtype and torch.equal(_raw(x), _raw(y)) for x, y in zip(ta, tb)
    )
