"""1-bit majority of P packed vote vectors, counted on whole words (Lion Cub Sec. 3, App. B.1).

Step 3 of the 1-bit majority vote (:mod:`lowbit_strategy.collectives.majority`): rank r
holds P rows of packed sign bits (one per sender) and needs, per element, whether more
than half of them are +1, ties (only for even P) by the alternating rule of
:func:`lowbit_strategy.codecs.signs.tie_is_positive`.

Unpacking every bit to a byte and summing costs several passes over 8·P bytes per 8
elements. Here the count is kept *bit-sliced*: the counter of 64 elements is a few int64
words, one per binary digit ("bit plane"), and a carry-save adder tree adds the P vote
words into them with bitwise ops on whole words; the threshold test is then a bitwise
comparison of those planes with a constant. That is about 3 word operations per vote word
(each full adder turns 3 words into 2 in 5 operations), so O(P) operations per 64
elements, independent of the element count of a word.
"""

from __future__ import annotations

import torch

from lowbit_strategy.codecs.signs import fused_kernels, tie_is_positive

#: Words per slice of the vote rows: the adder tree's temporaries (a few per row) stay
#: small enough to be cache-resident and recycled by the allocator (fresh large buffers
#: cost a page fault per 4 KiB on first touch, more than the bitwise work itself).
_SLICE_WORDS = 8192


def majority_threshold(world_size: int, step: int) -> int:
    """The least count of +1 votes (of ``world_size``) that makes the majority +1 at ``step``.

    ``2k > P`` wins; ``2k == P`` (a tie, even P only) wins on the steps where ties break
    upwards.
    """
    half = world_size // 2
    return half if world_size % 2 == 0 and tie_is_positive(step) else half + 1


def _full_add(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Bitwise full adder: (sum, carry) words of three words, 5 operations."""
    ab = a ^ b
    carry = a & b
    carry |= c & ab
    ab ^= c
    return ab, carry


def _count_planes(rows: list[torch.Tensor]) -> list[torch.Tensor]:
    """Bit planes of the per-bit population count of ``rows`` (int64 words), LSB first.

    A column-compression (Wallace) tree: ``columns[w]`` holds words of weight ``2**w``;
    full adders reduce any column of 3 or more, a half adder a column of 2, until each
    column holds one word. Input words are never written to.
    """
    columns: list[list[torch.Tensor]] = [list(rows)]
    w = 0
    while w < len(columns):
        column = columns[w]
        while len(column) > 1:
            if len(columns) == w + 1:
                columns.append([])
            if len(column) >= 3:
                s, carry = _full_add(column.pop(), column.pop(), column.pop())
            else:
                a, b = column.pop(), column.pop()
                s, carry = a ^ b, a & b
            column.insert(0, s)  # keep summing oldest-first so the tree stays shallow
            columns[w + 1].append(carry)
        w += 1
    return [column[0] for column in columns]


def _at_least(planes: list[torch.Tensor], threshold: int, like: torch.Tensor) -> torch.Tensor:
    """Words whose bit is 1 where the bit-sliced count ``planes`` is >= ``threshold`` (>= 1).

    Compares from the least significant digit up: with ``ge`` meaning "the low digits of
    the count are >= those of the threshold", a threshold digit 1 needs the count digit 1
    and ``ge``; a threshold digit 0 is passed by a count digit 1 or by ``ge``. Below the
    threshold's lowest 1 digit ``ge`` is trivially true, so the scan starts there. The
    result may be one of ``planes`` itself (never written to here).
    """
    low = (threshold & -threshold).bit_length() - 1
    if low >= len(planes):  # the count has no such digit: it is below the threshold
        return torch.zeros_like(like)
    ge = planes[low]  # the threshold's digit there is 1
    for j in range(low + 1, max(len(planes), threshold.bit_length())):
        if j >= len(planes):  # the count has no such digit: it is below the threshold
            return torch.zeros_like(like)
        if (threshold >> j) & 1:
            ge = ge & planes[j]
        else:
            ge = ge | planes[j]
    return ge


#: accepted values of ``method``
METHODS = ("auto", "bitsliced", "lanes", "fused")
#: the most rows the byte-lane counters of ``method="lanes"`` can count (a lane holds
#: count + 128 - threshold <= 255)
MAX_LANE_ROWS = 254
_LOW_BITS = 0x0101010101010101  # bit 0 of every byte of an int64 word


def majority_bits(words: torch.Tensor, step: int, method: str = "auto") -> torch.Tensor:
    """Packed majority of P packed 1-bit vote rows: (P, C) uint8 -> (C,) uint8.

    Row r holds rank r's votes in the layout of ``bits.pack(..., 1)`` (element i in byte
    i // 8 at bit i % 8, bit 1 = +1). Output bit i is 1 where 2·count > P, and for a tie
    (2·count == P, even P only) 1 iff ``tie_is_positive(step)``. Bit-for-bit equal to
    unpacking, summing and packing, whichever ``method``:

    * ``"bitsliced"``: the carry-save adder tree of the module docstring, O(P) bitwise
      word operations (each its own kernel): the fastest on a CPU;
    * ``"lanes"``: per bit position j, every row's bit j of every byte is summed at once
      into byte-lane counters (``((w >> j) & 0x01..01).sum(0)`` on int64 words: an exact
      integer sum) and compared with the threshold by one addition per lane: ~7 kernels
      per bit position whatever P (P <= :data:`MAX_LANE_ROWS`), for a GPU, where a kernel
      launch costs more than the bytes it touches;
    * ``"fused"``: one pass of :mod:`.signs_triton`'s kernel (per bit, an integer count over
      the rows, then the threshold) for CUDA tensors where triton imports (or CPU tensors
      under Triton's interpreter), up to ``signs_triton.MAX_ROWS`` rows; ``"lanes"``
      otherwise;
    * ``"auto"``: ``"fused"`` for CUDA tensors, ``"bitsliced"`` otherwise.
    """
    if method not in METHODS:
        raise ValueError(f"majority_bits: method must be one of {METHODS}, got {method!r}")
    if words.dtype != torch.uint8 or words.dim() != 2:
        raise TypeError(f"majority_bits needs a (P, C) uint8 tensor, got {words.dtype} of shape {tuple(words.shape)}")
    p, c = words.shape
    if p == 0:
        raise ValueError("majority_bits needs at least one row of votes")
    threshold = majority_threshold(p, step)
    if c == 0:
        return words.new_empty(0)
    if method == "auto" and words.is_cuda or method == "fused":
        fused = fused_kernels(words) if method == "auto" else _fused_for(words)
        if fused is not None and p <= fused.MAX_ROWS and words.stride(1) == 1:
            return fused.majority(words, threshold)
        method = "lanes"
    padded = words
    if c % 8 or not words.is_contiguous() or words.storage_offset() % 8:
        padded = words.new_zeros(p, -(-c // 8) * 8)
        padded[:, :c] = words
    rows = padded.view(torch.int64)
    if method == "auto":
        method = "lanes" if words.is_cuda else "bitsliced"
    if method == "lanes" and p <= MAX_LANE_ROWS:
        return _majority_lanes(rows, threshold).view(torch.uint8)[:c]
    winners = torch.empty_like(rows[0])
    for start in range(0, rows.shape[1], _SLICE_WORDS):
        part = rows[:, start : start + _SLICE_WORDS]
        winners[start : start + _SLICE_WORDS] = _at_least(_count_planes(list(part.unbind(0))), threshold, part[0])
    return winners.view(torch.uint8)[:c]


def _fused_for(words: torch.Tensor):
    """:mod:`.signs_triton` if its kernels serve ``words`` (CUDA, or the CPU under the
    interpreter), else ``None``."""
    if words.is_cuda:
        return fused_kernels(words)
    try:
        from lowbit_strategy.codecs import signs_triton
    except ImportError:  # pragma: no cover - triton's own import errors are caught there
        return None
    return signs_triton if signs_triton.serves(words) else None


def _majority_lanes(rows: torch.Tensor, threshold: int) -> torch.Tensor:
    """``method="lanes"`` of :func:`majority_bits` on (P, W) int64 words: the winners' words."""
    out = torch.zeros_like(rows[0])
    bias = (128 - threshold) * _LOW_BITS  # count + bias has bit 7 set iff count >= threshold
    for j in range(8):
        counts = ((rows >> j) & _LOW_BITS).sum(0)  # per byte: how many rows have bit j set
        out |= (((counts + bias) >> 7) & _LOW_BITS) << j
    return out
