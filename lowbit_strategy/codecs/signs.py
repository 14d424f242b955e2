"""Signs with a deterministic tie rule (Lion Cub App. B.1).

A 1-bit code cannot say "zero". Lion Cub found that sending exact zeros always as +1 (or
always as -1) accumulates a bias that makes training diverge (Fig. 10), and that
alternating the choice between steps fixes it at no cost:

    tie (exact zero) -> +1 on odd steps, -1 on even steps.

``step`` is the optimizer's step count, starting at 1 for the first step (as
``torch.optim`` counts it), so the very first step breaks ties upwards. The same rule is
used for the local signs a rank sends and for the tied votes of a majority.
"""

from __future__ import annotations

import torch

from lowbit_strategy.codecs.bits import pack_bools, pack_bytes_into_lanes
from lowbit_strategy.codecs.streaming import SLICE, sliced, slices
from lowbit_strategy.validation import is_int


def fused_kernels(t: torch.Tensor):
    """:mod:`.signs_triton` when its fused kernels serve ``t`` (a CUDA tensor, triton
    importable), else ``None``. Imported on the first CUDA tensor: triton is optional, and a
    CPU run never loads it."""
    if t.device.type != "cuda":
        return None
    from lowbit_strategy.codecs import signs_triton

    return signs_triton if signs_triton.serves(t) else None


_ONES: dict[torch.device, torch.Tensor] = {}


def tie_is_positive(step: int) -> bool:
    """Whether a tie at ``step`` resolves to +1 (odd steps) or -1 (even steps)."""
    if not is_int(step):
        raise TypeError(f"step must be an int (the optimizer step, from 1), got {step!r}")
    return step % 2 == 1


def _check_no_nan(x: torch.Tensor, what: str) -> None:
    # max propagates NaN: one reduction, no n-byte mask (``isnan(x).any()`` is ~15x slower)
    if x.dtype.is_floating_point and x.numel() and bool(x.amax().isnan()):
        raise ValueError(f"{what}: input contains NaN; its sign is undefined")


def compare_bytes(compare, a: torch.Tensor, b, out: torch.Tensor | None = None) -> torch.Tensor:
    """``compare(a, b)`` (``torch.ge``, ``torch.lt``, ...) as uint8 0/1 instead of bool.

    Same values as ``compare(a, b).view(torch.uint8)``; the comparison writes int8 directly
    (optionally into ``out``, an int8 tensor of the result's shape), which CPU kernels do
    ~1.5x faster than bool into a cache-resident buffer (1.2 against 2.0 ms for 4 Mi float32
    in slices of 256 Ki, one thread; about even into a fresh full-size one), and uint8 then
    feeds integer arithmetic without a cast.
    """
    if out is None:
        out = torch.empty(torch.broadcast_shapes(a.shape, torch.as_tensor(b).shape), dtype=torch.int8, device=a.device)
    return compare(a, b, out=out).view(torch.uint8)


def sign_bits(x: torch.Tensor, step: int, *, check_nan: bool = True) -> torch.Tensor:
    """1-bit sign codes of ``x``: uint8 1 for positive, 0 for negative.

    Exact zeros (+0 and -0) follow the alternating rule of :func:`tie_is_positive`.
    ``+inf`` and ``-inf`` are ordinary signs; NaN raises ``ValueError`` (``check_nan=False``
    skips that scan for callers that excluded non-finite input already).
    """
    if check_nan:
        _check_no_nan(x, "sign_bits")
    return compare_bytes(torch.ge if tie_is_positive(step) else torch.gt, x, 0)


def sign_bits_packed(x: torch.Tensor, step: int, *, check_nan: bool = True) -> torch.Tensor:
    """:func:`sign_bits` of ``x`` (flattened) packed 8 per byte, as ``bits.pack(..., 1)`` lays them.

    Returns ``ceil(x.numel() / 8)`` uint8 bytes, the last one zero-padded: equal to
    ``bits.pack(sign_bits(x.reshape(-1), step), 1)`` but written straight into a padded
    buffer that is packed in place, without a separate per-element code tensor.
    """
    if check_nan:
        _check_no_nan(x, "sign_bits_packed")
    flat = x.reshape(-1)
    n = flat.numel()
    compare = torch.ge if tie_is_positive(step) else torch.gt
    if sliced(flat):
        return _sign_bits_packed_sliced(flat, compare)
    votes = torch.empty(-(-n // 8) * 8, dtype=torch.int8, device=x.device)
    votes[n:] = 0
    compare_bytes(compare, flat, 0, out=votes[:n])
    return pack_bytes_into_lanes(votes.view(torch.uint8), 1, owned=True)


def _sign_bits_packed_sliced(flat: torch.Tensor, compare) -> torch.Tensor:
    """:func:`sign_bits_packed` slice by slice (:mod:`.streaming`): the votes of a slice as
    bool in one reused buffer, packed from there into the output (:func:`.bits.pack_bools`);
    no n-byte vote tensor."""
    n = flat.numel()
    out = torch.empty(-(-n // 8), dtype=torch.uint8, device=flat.device)
    buf = torch.empty(SLICE, dtype=torch.bool, device=flat.device)  # SLICE is a multiple of 8
    for start, stop in slices(n):
        votes = buf[: stop - start]
        compare(flat[start:stop], 0, out=votes.view(torch.int8))  # int8 out: see compare_bytes
        pack_bools(votes, out[start // 8 : -(-stop // 8)])
    return out


_SIGN_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def signs_from_bits(words: torch.Tensor, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """±1 of ``dtype`` for the first ``n`` bits of packed 1-bit ``words`` (bit 1 -> +1).

    Decodes through a 256 x 8 lookup table (one row gather per byte instead of unpacking,
    casting and rescaling every bit); same little-endian layout as
    :func:`lowbit_strategy.codecs.bits.pack`. ``index_select`` with int32 indices is the
    fast form of that gather (advanced indexing with int64 ones is ~4x slower on CPU). On
    CUDA the fused decode of :mod:`.signs_triton` with a scale of 1 (the same ±1).
    """
    if words.dtype != torch.uint8 or words.dim() != 1:
        raise TypeError(f"signs_from_bits needs 1-D uint8 words, got {words.dtype} of shape {tuple(words.shape)}")
    if not 0 <= n <= 8 * words.numel():
        raise ValueError(f"cannot decode n={n} signs from {words.numel()} bytes")
    fused = fused_kernels(words)
    if fused is not None and fused.decodes(dtype):
        ones = _ONES.get(words.device)
        if ones is None:
            ones = _ONES[words.device] = torch.ones(1, dtype=torch.float32, device=words.device)
        return fused.decode(words.view(1, -1), ones, n, dtype, None, None)
    key = (dtype, words.device)
    table = _SIGN_TABLES.get(key)
    if table is None:
        byte = torch.arange(256, device=words.device).unsqueeze(1)
        bits = (byte >> torch.arange(8, device=words.device)) & 1
        table = _SIGN_TABLES[key] = (bits * 2 - 1).to(dtype)
    return table.index_select(0, words.int()).reshape(-1)[:n]


def sign_alternating(x: torch.Tensor, step: int) -> torch.Tensor:
    """±1 of ``x`` as int8, exact zeros by the alternating rule (never 0)."""
    return sign_bits(x, step).to(torch.int8) * 2 - 1
