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

from dataclasses import dataclass

import torch

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
        raise ValueError(
            f"lane_bits={bits!r} is not supported; use one of {LANE_BITS}"
        ) from None


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
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi > spec.capacity:
            raise ValueError(
                f"codes must lie in [0, {spec.capacity}] for a {spec.bits}-bit lane, "
                f"got values in [{lo}, {hi}]"
            )


def pack(codes: torch.Tensor, lane_bits: int, *, validate: bool = True) -> torch.Tensor:
    """Pack 1-D unsigned ``codes`` into words of ``lane(lane_bits).word_dtype``.

    Returns a 1-D tensor of ``lane.words_for(len(codes))`` words on the same device.
    With ``validate`` (default) codes outside ``[0, capacity]`` raise ``ValueError``; pass
    ``validate=False`` on hot paths whose codes are in range by construction.
    """
    spec = lane(lane_bits)
    _check_codes(codes, spec, validate=validate)
    n = codes.numel()
    k = spec.per_word
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


def unpack(words: torch.Tensor, lane_bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: the first ``n`` codes of ``words``.

    Returns uint8 codes for lanes of up to 8 bits and int32 codes for wider lanes.
    """
    spec = lane(lane_bits)
    if words.dtype != spec.word_dtype:
        raise TypeError(
            f"a {spec.bits}-bit lane is packed in {spec.word_dtype} words, got {words.dtype}"
        )
    if words.dim() != 1:
        raise ValueError(f"words must be 1-D, got shape {tuple(words.shape)}")
    if n < 0 or n > words.numel() * spec.per_word:
        raise ValueError(
            f"cannot unpack n={n} codes from {words.numel()} words of {spec.per_word} lanes"
        )
    k = spec.per_word
    if k == 1:
        return words[:n].clone()
    shifts = torch.arange(0, k * spec.bits, spec.bits, device=words.device, dtype=words.dtype)
    mask = (1 << spec.bits) - 1
    codes = (words.unsqueeze(1) >> shifts) & mask
    return codes.reshape(-1)[:n]
