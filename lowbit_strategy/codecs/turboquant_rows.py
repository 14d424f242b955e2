"""TurboQuant codes of many rows at once: a collective's P chunks or P gathered payloads.

A collective that sends one TurboQuant payload per rank (or per chunk) decodes P of them on
every rank, and the two-stage form encodes P chunks: one codec call each would launch
kernels in proportion to P (tens of thousands per step on a GPU at P = 64). These functions
take the ``R`` payloads as rows of one tensor and give each row bit for bit what the codec
gives it alone (:class:`~lowbit_strategy.codecs.turboquant.TurboQuantCodec`'s rules: every
row uses the rotation signs of ``m`` elements, its own scale groups), in a number of kernels
that does not grow with ``R``: the torch backend always for decoding, and for encoding when
rows are whole blocks on whole bytes; the Triton kernels when rows are whole blocks on whole
bytes (the rotation's sign bits repeated per row). Other rows go one by one.
"""

from __future__ import annotations

import torch

from lowbit_strategy.codecs import turboquant, turboquant_torch
from lowbit_strategy.codecs.bits import unpack
from lowbit_strategy.codecs.hadamard import blocked_fwht_rows
from lowbit_strategy.codecs.turboquant import TurboQuantCodec, TurboQuantPayload


@torch.no_grad()
def decode_rows(codec: TurboQuantCodec, codes: torch.Tensor, scales: torch.Tensor, m: int) -> torch.Tensor:
    """Decode ``R`` payloads of ``m`` elements at once (a collective's gathered rows):
    ``codes`` ``(R, k)`` uint8, row ``r`` the codes of one float32 payload of ``m``
    elements; ``scales`` ``(R, g)`` float32, its ``g = ceil(m / block)`` scales (or 1,
    shared by the row). Returns ``(R, m)`` float32, row ``r`` bit for bit
    ``decode(row r's payload)``, in a number of kernels that does not grow with ``R``
    (torch backend; the Triton backend when rows are whole blocks on whole bytes)."""
    rows, k = codes.shape
    scales = scales.reshape(rows, -1)
    if m == 0 or rows == 0:
        return torch.zeros(rows, m, dtype=torch.float32, device=codes.device)
    device, b = codes.device, codec.block
    if codec._use_triton(device):
        fused = m % b == 0 and m % 8 == 0 and (m * codec.lane_bits) % 8 == 0
        if not fused:  # rows that end inside a block or a byte: one decode each
            return torch.stack([codec.decode(_row_payload(codec, codes[r], scales[r], m)) for r in range(rows)])
        tt, q = turboquant.triton_module(), m // b
        out = torch.empty(rows * m, dtype=torch.float32, device=device)
        bits = codec._row_sign_bits(m, rows, device) if codec.rotate else None
        tt.decode_blocks(
            codes.contiguous().view(-1),
            rows * q,
            b,
            sign_bits=bits,
            scales=scales.expand(rows, q).contiguous().view(-1),
            levels=codec._tables(device)[0],
            lane_bits=codec.lane_bits,
            out=out,
        )
        return out.view(rows, m)
    per_row = k * (8 // codec.lane_bits)
    idx = unpack(codes.contiguous().view(-1), codec.lane_bits, rows * per_row).view(rows, per_row)[:, :m]
    signs = codec.signs(m, device) if codec.rotate else None
    return turboquant_torch.decode_rows(idx, scales, signs, block=b, levels=codec._tables(device)[0])


@torch.no_grad()
def encode_rows(codec: TurboQuantCodec, x: torch.Tensor, scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode the ``R`` rows of a 2-D float32 ``x`` (``R`` payloads of ``m`` elements, e.g.
    a collective's chunks) at once: ``(codes (R, k), scales (R, g))``, row ``r`` bit for
    bit ``encode(x[r], scale of row r)``. ``scale``: None (each group's RMS), one value
    for every row, or ``R·g`` values (row ``r``'s at ``[r·g, (r+1)·g)``). A number of
    kernels that does not grow with ``R`` when rows are whole blocks on whole bytes;
    other rows are encoded one by one."""
    rows, m = x.shape
    b, device = codec.block, x.device
    g = codec._groups(m)
    given = None if scale is None else codec._check_scale(scale, rows * m, device, groups=rows * g)
    if m % b or (m * codec.lane_bits) % 8 or rows == 0:
        one = [given] * rows if given is None or given.numel() == 1 else list(given.view(rows, g))
        payloads = [codec.encode(x[r], one[r]) for r in range(rows)]
        return torch.stack([q.codes for q in payloads]), torch.stack([q.scales.reshape(-1) for q in payloads])
    k = m * codec.lane_bits // 8
    if codec._use_triton(device) and m % 8 == 0:
        tt = turboquant.triton_module()
        codes = torch.empty(rows * k, dtype=torch.uint8, device=device)
        scales = torch.empty(rows * g, dtype=torch.float32, device=device)
        bits = codec._row_sign_bits(m, rows, device) if codec.rotate else None
        tt.encode_blocks(
            x.contiguous().view(-1),
            rows * g,
            b,
            sign_bits=bits,
            scales=given,
            midpoints=codec._tables(device)[1],
            bits=codec.bits,
            lane_bits=codec.lane_bits,
            codes_out=codes,
            scales_out=None if given is not None else scales,
        )
        return codes.view(rows, k), _row_scales(scales, given, rows, g)
    v = x.to(torch.float32)
    y = blocked_fwht_rows(v * codec.signs(m, device), b) if codec.rotate else v.clone()
    codes, scales = codec._encode_torch(y.view(-1), None, given, owned=True)  # whole groups: rows concatenate
    return codes.view(rows, k), _row_scales(scales, given, rows, g)


def _row_scales(computed: torch.Tensor, given: torch.Tensor | None, rows: int, g: int) -> torch.Tensor:
    """The scales each row's payload holds, as ``(R, ·)``: the computed ``g`` per row, or the
    given ones (one value: each row's payload holds that one value, as ``encode`` keeps it)."""
    if given is None:
        return computed.view(rows, g)
    if given.numel() == 1:
        return given.reshape(1, 1).expand(rows, 1).contiguous()
    return given.view(rows, g)


def _row_payload(codec: TurboQuantCodec, codes: torch.Tensor, scales: torch.Tensor, m: int) -> TurboQuantPayload:
    return TurboQuantPayload(codes, scales, torch.Size([m]), torch.float32, m, codec.bits, codec.block)
