"""DeMo's payload: the top-k DCT coefficients of every chunk of a worker's momentum, packed.

"DeMo: Decoupled Momentum Optimization" (Peng, Quesnelle, Kingma, arXiv:2411.19870), Sec. 3.1 and
Algorithm 1: each worker keeps the ``k`` coefficients of largest magnitude in each chunk of the
chunked DCT (:mod:`.dct`) of its momentum δ, sends them, removes what it sent from δ, and steps by
the sign of the inverse DCT of the per-coefficient mean of what every worker sent.

**Selection.** Per chunk the ``k`` largest ``|coefficient|`` (``k`` clamped to the chunk's size);
ties go to the lower index (:func:`select`), so the same data gives the same set on any device
(the ranks of a node, which each send part of the node's payload, select alike).

**Values** (``values``):

* ``fp32`` — the coefficients as they are (DeMo's);
* ``bf16`` — rounded to bfloat16 (round to nearest even);
* ``sign`` — one bit per kept coefficient and one bfloat16 scale per chunk, the mean ``|c|`` of
  the chunk's kept coefficients (the scale that minimises the squared error of a sign code);
  a coefficient of exactly 0 is sent as ``+scale`` (the tie rule).

What a worker removes from δ is exactly what the others decode from its payload: the values
*after* rounding (:meth:`TopKCodec.encode` returns them decoded).

**Payload** of one worker: byte 0 its non-finite flag, then per tensor its indices packed to
``⌈log2(chunk size)⌉`` bits each (:mod:`.bitfield`; DeMo sends int64), then its values (fp32,
bf16, or sign bits then scales), each field starting at a multiple of 4 bytes.

**Mean** over the gathered payloads: per coefficient, the sum over the workers that sent it
(in worker order: a fixed order, so every worker computes the same bits) divided by their
count; coefficients nobody sent are 0.

Pure tensor code: no process group; nothing read on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lowbit_strategy.codecs.bitfield import bitfield_bytes, pack_bitfield, unpack_bitfield
from lowbit_strategy.codecs.bits import pack, unpack
from lowbit_strategy.codecs.dct import ChunkDCT, chunk_shape

__all__ = ["VALUES", "Segment", "TopKCodec", "layout", "select"]

#: the value codes
VALUES = ("fp32", "bf16", "sign")
#: every payload field starts at a multiple of this many bytes (fp32 views of the bytes)
ALIGN = 4


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def select(coeffs: torch.Tensor, k: int) -> torch.Tensor:
    """Indices ``(chunks, k)`` of the ``k`` largest ``|coeffs|`` of each row (ties: lower index),
    in no particular order.

    One ``topk`` over unique int64 keys: the bits of ``|c|`` as float32 (ordered like the
    magnitudes, for non-negative floats) shifted left, the reversed index in the low bits. So
    the tie rule is exact and the same on every device, at about a sixth of a stable sort's
    time on the CPU (4096-coefficient chunks)."""
    size = coeffs.shape[1]
    low = max(size - 1, 0).bit_length()
    rev = torch.arange(size - 1, -1, -1, device=coeffs.device, dtype=torch.int64)
    key = (coeffs.abs().to(torch.float32).view(torch.int32).to(torch.int64) << low) | rev
    return torch.topk(key, k, dim=1, sorted=False).indices


@dataclass(frozen=True)
class Segment:
    """One tensor's part of the payload (byte offsets from the payload's start)."""

    chunks: int
    size: int
    k: int
    index_bits: int
    index_at: int
    values_at: int
    scales_at: int  #: sign values only (else = end)
    end: int


def layout(shapes: Sequence[tuple[int, ...]], chunk: int, topk: int, values: str) -> tuple[list[Segment], int]:
    """Each tensor's :class:`Segment` and the bytes of one worker's payload (module docstring),
    from the shapes alone: what :class:`TopKCodec` sends, and what the planner prices."""
    if values not in VALUES:
        raise ValueError(f"TopKCodec: values={values!r}; expected one of {VALUES}")
    segments, at = [], ALIGN  # byte 0: the flag
    for shape in shapes:
        (r, c), rows, cols = chunk_shape(shape, chunk)
        chunks = (rows // r) * (cols // c) if rows * cols else 0
        size = r * c
        k = min(topk, size)
        n = chunks * k
        bits = max(size - 1, 0).bit_length()
        values_at = _up(at + bitfield_bytes(n, bits))
        if values == "sign":
            scales_at = _up(values_at + -(-n // 8))
            end = _up(scales_at + 2 * chunks)
        else:
            scales_at = end = _up(values_at + n * (4 if values == "fp32" else 2))
        segments.append(Segment(chunks, size, k, bits, at, values_at, scales_at, end))
        at = end
    return segments, at


class TopKCodec:
    """Encode a worker's tensors into one payload, decode the mean of several.

    shapes: the tensors' shapes (a sharded run's local shards); chunk: the chunk target
    (``compression_chunk``); topk: coefficients kept per chunk; values: :data:`VALUES`.
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]], chunk: int, topk: int, values: str, device):
        self.segments, self.nbytes = layout(shapes, chunk, topk, values)  #: nbytes: one worker's payload
        self.values, self.device = values, torch.device(device)
        self.transforms = [ChunkDCT(s, chunk, self.device) for s in shapes]

    # ---- one worker ----------------------------------------------------------------------
    def encode(
        self, tensors: Sequence[torch.Tensor], bad: bool | torch.Tensor = False
    ) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """``(payload, sent, energy)``: the payload (uint8, :attr:`nbytes`), each tensor's sent
        part in its own domain (what the receivers decode from this payload; subtract it from δ)
        and the share of the tensors' energy sent (a 0-d tensor: ``‖sent‖² / ‖x‖²``, orthonormal
        transform). ``bad`` (a bool, or a 0-d bool tensor left on the device) sets the payload's
        non-finite flag."""
        payload = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        payload[0] = bad.to(torch.uint8) if isinstance(bad, torch.Tensor) else int(bad)
        sent, kept, total = [], torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        for t, seg, x in zip(self.transforms, self.segments, tensors):
            if seg.chunks == 0:
                sent.append(torch.zeros_like(x))
                continue
            coeffs = t.encode(x.to(torch.float32))
            idx = select(coeffs, seg.k)
            q = self._quantize(torch.gather(coeffs, 1, idx), payload, seg)
            payload[seg.index_at : seg.index_at + bitfield_bytes(idx.numel(), seg.index_bits)] = pack_bitfield(
                idx.reshape(-1), seg.index_bits
            )
            dense = torch.zeros_like(coeffs).scatter_(1, idx, q)
            sent.append(t.decode(dense).to(x.dtype))
            kept += q.reshape(-1).dot(q.reshape(-1))
            total += coeffs.reshape(-1).dot(coeffs.reshape(-1))  # (no squared copy of the coefficients)
        return payload, sent, kept / total.clamp_min(torch.finfo(torch.float32).tiny)

    def _quantize(self, val: torch.Tensor, payload: torch.Tensor, seg: Segment) -> torch.Tensor:
        """Write ``val`` ``(chunks, k)`` into ``payload`` as ``values`` says; return what the
        receivers will decode."""
        n = val.numel()
        if self.values == "fp32":
            payload[seg.values_at : seg.values_at + 4 * n] = val.reshape(-1).contiguous().view(torch.uint8)
            return val
        if self.values == "bf16":
            b = val.to(torch.bfloat16)
            payload[seg.values_at : seg.values_at + 2 * n] = b.reshape(-1).view(torch.uint8)
            return b.to(torch.float32)
        scale = val.abs().mean(1, keepdim=True).to(torch.bfloat16)
        positive = val >= 0
        payload[seg.values_at : seg.values_at + -(-n // 8)] = pack(
            positive.reshape(-1).to(torch.uint8), 1, validate=False
        )
        payload[seg.scales_at : seg.scales_at + 2 * seg.chunks] = scale.reshape(-1).view(torch.uint8)
        s = scale.to(torch.float32)
        return torch.where(positive, s, -s)

    # ---- decoding --------------------------------------------------------------------------
    def _read(self, payload: torch.Tensor, seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """One worker's ``(indices, values)`` of one segment, ``(chunks, k)`` each."""
        n = seg.chunks * seg.k
        idx = unpack_bitfield(payload[seg.index_at : seg.values_at], seg.index_bits, n).view(seg.chunks, seg.k)
        if self.values == "fp32":
            val = payload[seg.values_at : seg.values_at + 4 * n].view(torch.float32)
        elif self.values == "bf16":
            val = payload[seg.values_at : seg.values_at + 2 * n].view(torch.bfloat16).to(torch.float32)
        else:
            positive = unpack(payload[seg.values_at : seg.scales_at], 1, n).view(seg.chunks, seg.k).bool()
            s = payload[seg.scales_at : seg.scales_at + 2 * seg.chunks].view(torch.bfloat16).to(torch.float32)
            s = s.view(seg.chunks, 1).expand(seg.chunks, seg.k)
            val = torch.where(positive, s, -s)
        return idx, val.reshape(seg.chunks, seg.k)

    def flags(self, gathered: torch.Tensor) -> torch.Tensor:
        """Each worker's non-finite flag, ``(workers,)`` bool (on the device)."""
        return gathered[:, 0] != 0

    def mean(self, gathered: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The per-coefficient mean of the workers' payloads ``gathered`` ``(workers, nbytes)``,
        back in each tensor's domain (shapes and dtypes of ``like``)."""
        out = []
        for t, seg, x in zip(self.transforms, self.segments, like):
            if seg.chunks == 0:
                out.append(torch.zeros_like(x))
                continue
            sums = torch.zeros(seg.chunks, seg.size, device=self.device)
            counts = torch.zeros(seg.chunks, seg.size, device=self.device)
            ones = torch.ones(seg.chunks, seg.k, device=self.device)
            for w in range(gathered.shape[0]):  # worker order: fixed; each worker's indices are distinct
                idx, val = self._read(gathered[w], seg)
                sums.scatter_add_(1, idx, val)
                counts.scatter_add_(1, idx, ones)
            out.append(t.decode(sums / counts.clamp_min(1)).to(x.dtype))
        return out

    def decode_one(self, payload: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One worker's sent tensors from its ``payload`` (what :meth:`encode` returned as ``sent``)."""
        out = []
        for t, seg, x in zip(self.transforms, self.segments, like):
            if seg.chunks == 0:
                out.append(torch.zeros_like(x))
                continue
            idx, val = self._read(payload, seg)
            out.append(
                t.decode(torch.zeros(seg.chunks, seg.size, device=self.device).scatter_(1, idx, val)).to(x.dtype)
            )
        return out
