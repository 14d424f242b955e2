"""Bit lanes: pack small unsigned codes into machine words and back.

A *lane* is a fixed-width bit field inside a word. Codes of ``lane_bits`` bits are laid
out little-endian inside each word: element ``i`` sits in word ``i // k`` at bit offset
``(i % k) * lane_bits``, with ``k = word_bits // lane_bits`` lanes per word.

Supported lanes and their words (the words every backend can SUM-allreduce: gloo has no
int16 sum and NCCL no uint16, so lanes wider than 8 bits live in int32 words):

=========  ==========  ==============  ==========================================
lane bits  word dtype  lanes per word  largest value a lane may hold (capacity)
=========  ==========  ==============  ==========================================
1, 2, 4, 8 uint8       8, 4, 2, 1      ``2**lane_bits - 1``
16         int32       2               ``2**15 - 1`` (top bit of each lane kept 0)
32         int32       1               ``2**31 - 1`` (the sign bit kept 0)
=========  ==========  ==============  ==========================================

For int32 words the top bit of every lane is reserved, so a word's signed value never
overflows however its lanes are summed within capacity; the sum is then exact.

Why lanes: adding two packed words adds their lanes element-wise, as long as no lane
sum exceeds the capacity (no carry into the neighbouring lane). That is what lets the
p-bit direct allreduce of Lion Cub (Sec. 3, App. F.1) sum many small codes with one
ordinary integer allreduce.

Padding: a length that is not a multiple of ``k`` is padded with zero codes up to a whole
word; :func:`unpack` needs the original length ``n`` to drop them.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from lowbit_strategy.codecs.streaming import SLICE, sliced, slices

_np: types.ModuleType | None
try:  # numpy.packbits: the fast 1-bit packer on the CPU (pack_bools)
    import numpy as _np
except ImportError:  # pragma: no cover - numpy comes with torchmetrics
    _np = None

LANE_BITS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Lane:
    """The layout of one lane width: word dtype, lanes per word, and value capacity."""

    bits: int
    word_dtype: torch.dtype
    per_word: int
    capacity: int

    @property
    def word_bytes(self) -> int:
        return torch.empty((), dtype=self.word_dtype).element_size()

    def words_for(self, n: int) -> int:
        """Number of words that hold ``n`` codes (the last one zero-padded)."""
        return -(-n // self.per_word)

    def packed_bytes(self, n: int) -> int:
        """Bytes of the packed form of ``n`` codes."""
        return self.words_for(n) * self.word_bytes


_LANES = {
    1: Lane(1, torch.uint8, 8, 1),
    2: Lane(2, torch.uint8, 4, 3),
    4: Lane(4, torch.uint8, 2, 15),
    8: Lane(8, torch.uint8, 1, 255),
    16: Lane(16, torch.int32, 2, 2**15 - 1),
    32: Lane(32, torch.int32, 1, 2**31 - 1),
}


def lane(bits: int) -> Lane:
    """The :class:`Lane` for ``bits``; raises ``ValueError`` for an unsupported width."""
    try:
        return _LANES[int(bits)]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"lane_bits={bits!r} is not supported; use one of {LANE_BITS}") from None


def narrowest_lane(max_value: int) -> Lane:
    """The narrowest lane whose capacity holds ``max_value``.

    Raises ``OverflowError`` when no supported word can hold it (more than ``2**31 - 1``).
    """
    for bits in LANE_BITS:
        if _LANES[bits].capacity >= max_value:
            return _LANES[bits]
    raise OverflowError(
        f"a lane must hold values up to {max_value}, more than the widest supported "
        f"lane (32 bits, capacity {_LANES[32].capacity})"
    )


def _check_codes(codes: torch.Tensor, spec: Lane, *, validate: bool) -> None:
    if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got dtype {codes.dtype}")
    if codes.dim() != 1:
        raise ValueError(f"codes must be 1-D (flatten first), got shape {tuple(codes.shape)}")
    if validate and codes.numel():
        lo, hi = (int(v) for v in torch.aminmax(codes))  # one pass for both bounds
        if lo < 0 or hi > spec.capacity:
            raise ValueError(
                f"codes must lie in [0, {spec.capacity}] for a {spec.bits}-bit lane, got values in [{lo}, {hi}]"
            )


#: The integer dtype as wide as the ``k`` byte-sized codes that make one packed byte.
_GROUP_DTYPE = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def gather_multiplier(lane_bits: int) -> int:
    """The constant that moves the ``k = 8 // lane_bits`` bytes of a word into its top byte.

    A group of ``k`` codes, one per byte, read as one little-endian ``8k``-bit integer has
    code ``i`` at bit ``8i``; multiplying by ``2**(8(k-1) - (8 - lane_bits)·i)`` summed over
    ``i`` moves a copy of code ``i`` to bit ``8(k-1) + lane_bits·i``, which lays the packed
    byte out in the top byte. All partial products land on disjoint bits (checked for
    1, 2 and 4-bit codes within capacity), so no carry disturbs it; products past the top
    bit wrap away. One multiply per 8 codes instead of one shift-or per code.
    """
    k = 8 // lane_bits
    return sum(1 << (8 * (k - 1) - (8 - lane_bits) * i) for i in range(k))  # < 2**(8k-1)


def pack_bytes_into_lanes(
    codes: torch.Tensor, lane_bits: int, *, owned: bool = False, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Pack uint8 ``codes`` (one code of ``lane_bits`` < 8 bits per byte) into bytes.

    ``codes`` must be contiguous with ``numel`` a multiple of ``k = 8 // lane_bits`` and
    a storage offset a multiple of ``k``. With ``owned`` the caller gives up ``codes``
    and it is overwritten (saves a temporary as large as the input). Codes above the
    lane's capacity give unspecified bytes. Little-endian hosts (every torch platform).
    ``out``: uint8 of ``numel / k`` bytes to write the packed bytes into (returned).
    """
    k = 8 // lane_bits
    groups = codes.view(_GROUP_DTYPE[k])
    m = gather_multiplier(lane_bits)
    groups = groups.mul_(m) if owned else groups * m
    top = groups.view(torch.uint8)[k - 1 :: k]
    return top.contiguous() if out is None else out.copy_(top)


def pack_bools(votes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Pack 1-D bool ``votes`` into ``out`` (uint8, ``ceil(len / 8)`` bytes) as
    ``pack(votes, 1)`` lays them out, the last byte zero-padded; returns ``out``.

    On the CPU through ``numpy.packbits(..., bitorder="little")`` (same layout: element
    ``i`` at bit ``i % 8`` of byte ``i // 8``, padding bits 0), a SIMD kernel ~1.7x faster
    than the multiply of :func:`pack_bytes_into_lanes` plus its strided copy; elsewhere, or
    without numpy (a dependency of torchmetrics, so normally present), that multiply."""
    if votes.device.type == "cpu" and _np is not None:
        out.numpy()[:] = _np.packbits(votes.numpy(), bitorder="little")
        return out
    n = votes.numel()
    padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=votes.device)
    padded[:n] = votes.view(torch.uint8)
    return pack_bytes_into_lanes(padded, 1, owned=True, out=out)


def _bytes_padded(codes: torch.Tensor, k: int) -> tuple[torch.Tensor, bool]:
    """``codes`` as uint8 ready for :func:`pack_bytes_into_lanes`, and whether it is a copy."""
    n = codes.numel()
    if codes.dtype == torch.uint8 and codes.is_contiguous() and n % k == 0 and codes.storage_offset() % k == 0:
        return codes, False
    padded = torch.zeros(-(-n // k) * k, dtype=torch.uint8, device=codes.device)
    padded[:n] = codes
    return padded, True


def pack(codes: torch.Tensor, lane_bits: int, *, validate: bool = True) -> torch.Tensor:
    """Pack 1-D unsigned ``codes`` into words of ``lane(lane_bits).word_dtype``.

    Returns a 1-D tensor of ``lane.words_for(len(codes))`` words on the same device.
    With ``validate`` (default) codes outside ``[0, capacity]`` raise ``ValueError``; pass
    ``validate=False`` on hot paths whose codes are in range by construction (codes out of
    range then give unspecified words).

    1, 2 and 4-bit lanes pack 8, 4 or 2 codes with one integer multiply
    (:func:`pack_bytes_into_lanes`); wider lanes shift and OR.
    """
    spec = lane(lane_bits)
    _check_codes(codes, spec, validate=validate)
    n = codes.numel()
    k = spec.per_word
    if spec.bits < 8:
        padded, owned = _bytes_padded(codes, k)
        return pack_bytes_into_lanes(padded, spec.bits, owned=owned)
    work_dtype = torch.uint8 if spec.word_dtype == torch.uint8 else torch.int32
    padded = codes.to(work_dtype)
    if n % k:
        padded = torch.cat([padded, padded.new_zeros(k - n % k)])
    if k == 1:
        return padded.clone() if padded.data_ptr() == codes.data_ptr() else padded
    grid = padded.view(-1, k)
    word = grid[:, 0].clone()
    for j in range(1, k):
        word |= grid[:, j] << (j * spec.bits)
    return word


_UNPACK_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _unpack_table(lane_bits: int, device: torch.device) -> torch.Tensor:
    """For every byte value, its ``k`` codes as ``k`` bytes, read as one ``8k``-bit word."""
    key = (lane_bits, device)
    table = _UNPACK_TABLES.get(key)
    if table is None:
        k = 8 // lane_bits
        byte = torch.arange(256, device=device, dtype=torch.int32).unsqueeze(1)
        shifts = torch.arange(0, 8, lane_bits, device=device, dtype=torch.int32)
        codes = ((byte >> shifts) & ((1 << lane_bits) - 1)).to(torch.uint8)
        table = _UNPACK_TABLES[key] = codes.contiguous().view(_GROUP_DTYPE[k]).reshape(256)
    return table


def unpack(words: torch.Tensor, lane_bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``n`` codes of ``words``.

    Returns uint8 codes for lanes of up to 8 bits and int32 codes for wider lanes.
    1, 2 and 4-bit lanes decode a whole byte at a time through a 256-entry table whose
    entries are the byte's codes (one gather per byte instead of a shift and a mask per
    code).
    """
    spec = lane(lane_bits)
    if words.dtype != spec.word_dtype:
        raise TypeError(f"a {spec.bits}-bit lane is packed in {spec.word_dtype} words, got {words.dtype}")
    if words.dim() != 1:
        raise ValueError(f"words must be 1-D, got shape {tuple(words.shape)}")
    if n < 0 or n > words.numel() * spec.per_word:
        raise ValueError(f"cannot unpack n={n} codes from {words.numel()} words of {spec.per_word} lanes")
    k = spec.per_word
    if k == 1:
        return words[:n].clone()
    if spec.bits < 8:
        if spec.bits == 4 and words.device.type == "cpu":
            return _unpack_nibbles(words)[:n]
        table = _unpack_table(spec.bits, words.device)
        if not sliced(words):
            return table.index_select(0, words.int()).view(torch.uint8)[:n]
        # slice by slice (:mod:`.streaming`): the int32 indices in a reused buffer, the
        # gathered groups straight into the output
        groups = torch.empty(words.numel(), dtype=table.dtype, device=words.device)
        index = torch.empty(SLICE, dtype=torch.int32, device=words.device)
        for start, stop in slices(words.numel()):
            idx = index[: stop - start].copy_(words[start:stop])
            torch.index_select(table, 0, idx, out=groups[start:stop])
        return groups.view(torch.uint8)[:n]
    shifts = torch.arange(0, k * spec.bits, spec.bits, device=words.device, dtype=words.dtype)
    codes = torch.empty(words.numel(), k, dtype=words.dtype, device=words.device)
    torch.bitwise_right_shift(words.unsqueeze(1), shifts, out=codes)
    return codes.bitwise_and_((1 << spec.bits) - 1).view(-1)[:n]  # in place: no second full-size tensor


def _unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """The two 4-bit codes of every byte of ``words`` as two bytes (uint8, ``2·len``), by
    arithmetic on int16 instead of a table gather (~2x faster on CPU): a byte ``v = 16·hi +
    lo`` widened to int16, ``(v | v << 4) & 0x0F0F`` holds ``lo`` in its low byte and ``hi``
    in its high byte, which is the little-endian layout of codes ``2i, 2i + 1``. Slice by
    slice (:mod:`.streaming`), the shifted copy in a reused buffer."""
    out = torch.empty(words.numel(), dtype=torch.int16, device=words.device)
    shifted = torch.empty(min(SLICE, words.numel()), dtype=torch.int16, device=words.device)
    for start, stop in slices(words.numel()):
        v = out[start:stop].copy_(words[start:stop])
        spread = torch.bitwise_left_shift(v, 4, out=shifted[: stop - start])
        v.bitwise_or_(spread).bitwise_and_(0x0F0F)
    return out.view(torch.uint8)
