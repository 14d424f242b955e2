"""Compiled codec chains: the elementwise part of some codecs as one ``torch.compile`` pass.

Opt-in (``LowBitConfig.compile_codecs``, applied once by
:func:`lowbit_strategy.integrations.ddp.build_sync`, or :func:`use_compiled` directly):
inductor's first compile costs seconds per chain and process (13-14 s cold for the first,
which also loads inductor, 1-1.5 s for each next; 4-5 s and 0.1-0.3 s from its cache:
``benchmarks/results/codecs/codecs_compiled.md``). When it is on,
:func:`.lp.lp_quantize_levels` (and so :func:`.lp.lp_quantize`), :func:`.channel.channel_encode`
(2-bit) and :func:`.scaled_signs.scaled_sign_compress` (one scale) hand the work after their
checks and eager reductions to a chain here, which returns ``None`` when it does not apply;
the eager code stays the reference and runs otherwise.

Bit for bit the eager results, by construction (and checked by
``tests/codecs/test_compiled.py`` over sizes, dtypes, ties, signed zeros, subnormals and
thread counts):

* **Only elementwise work is compiled** (casts, multiply, round, clamp, comparisons, integer
  packing): inductor evaluates each element with the same float32 operations as eager, and
  builds its C++ with ``-ffp-contract=off`` (no fused multiply-add).
* **Reductions whose rounding depends on their order stay eager**: the L_p means, the channel
  means and kept sums, the 1-bit compressor's norm. Integer counts (packed bits, the
  ternary kept counts) are exact in any order and may be compiled. For p = 1 the chain
  writes ``|x|`` into a reused buffer and the eager ``mean()`` reads it: the same values
  as eager's fresh ``x.abs()``, without its page faults (the buffer, as long as the
  longest input, is kept for the process).

Not compiled: the TurboQuant codec (its Hadamard butterflies are ten order-fixed passes per
block; inductor's code for them, and for its 4-bit packing, measured slower than the eager
cache-sliced passes) and the 1-bit sign packers (the eager ``numpy.packbits`` path is faster).

On CUDA the same chains become inductor's Triton kernels. They hold eager's bits there by the
same argument: every float operation is elementwise and rounds once, and no float multiply
feeds an add (the L_p chain multiplies then rounds, the sign chain subtracts ±s), so no
contraction into an FMA can change a result; the one-GPU check (``make gpu-check``, part 2)
compares them with eager bit for bit and times them.

CPU and CUDA tensors of at least :data:`MIN_NUMEL` elements. Nothing is compiled at import: a
chain compiles on its first call, once per set of constants (levels, dtypes) with dynamic
sizes, so buckets of different lengths share one kernel. If compiling or running a chain
raises (no C++ compiler, an unsupported platform), it warns once and the eager codec serves
it for the rest of the process; so does a chain whose first call's result differs from the
same chain run eagerly (:func:`_run`).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import torch

from lowbit_strategy.codecs.bits import gather_multiplier
from lowbit_strategy.codecs.streaming import sliced

__all__ = ["compiled_enabled", "use_compiled"]

_enabled = False
#: compiled chains by (chain name, constants)
_chains: dict[tuple[Any, ...], Callable[..., Any]] = {}
#: chains whose compilation failed: eager from then on
_failed: set[str] = set()


def use_compiled(enabled: bool) -> None:
    """Turn the compiled codec chains on or off for this process (compiles nothing yet)."""
    global _enabled
    _enabled = bool(enabled)


def compiled_enabled() -> bool:
    """Whether the public codecs dispatch to the compiled chains."""
    return _enabled


def _compile(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` of one chain (a seam for tests that simulate a missing compiler)."""
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _fresh(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own: dynamo caches compiled graphs per code object
    (and gives up after a few), so every set of constants gets its own."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def _run(name: str, key: tuple[Any, ...], build: Callable[[], Callable[..., Any]], *args: Any) -> Any:
    """The chain ``name`` for the constants ``key`` (built by ``build`` and compiled on first
    use) applied to ``args``; ``None`` when this chain cannot be compiled (warned once).

    A chain's first call is checked: the same chain run eagerly on copies of the arguments must
    give the compiled result, and leave the arguments it writes (a chain may update an input in
    place), bit for bit; else (a miscompiled kernel: inductor once reused, from its on-disk cache,
    a kernel built for another ``ATEN_CPU_CAPABILITY``, which returned zeros) the arguments are
    restored, the chain is dropped with a warning and the eager codec serves it for the rest of
    the process. One eager run and two copies of the arguments per chain and set of constants."""
    if name in _failed:
        return None
    slot = (name, *key)
    fn = _chains.get(slot)
    try:
        if fn is not None:
            return fn(*args)
        chain = build()
        fn = _compile(_fresh(chain, "_".join(map(str, key)).replace(".", "_")))
        before = _snapshot(args)
        mine = _snapshot(before)
        got = fn(*args)
        want = chain(*mine)  # eager: the same operations, on copies
        if not (_same_bits(_snapshot(got), want) and _same_bits(_snapshot(args), mine)):
            for a, b in zip(args, before):  # as they were: the eager codec starts from them
                if isinstance(a, torch.Tensor):
                    a.copy_(b)
            _failed.add(name)
            warnings.warn(
                f"compile_codecs: the compiled {name} codec chain gave other bits than eager on its first call "
                "(a miscompiled or stale cached kernel: is TORCHINDUCTOR_CACHE_DIR shared between runs with "
                "different ATEN_CPU_CAPABILITY?); the eager codecs are used instead",
                RuntimeWarning,
                stacklevel=3,
            )
            return None
        _chains[slot] = fn
        return got
    except Exception as exc:  # noqa: BLE001 - any compiler failure: fall back to eager
        _failed.add(name)
        warnings.warn(
            f"compile_codecs: torch.compile failed for the {name} codec chain "
            f"({type(exc).__name__}: {exc}); the eager codecs are used instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def _snapshot(out: Any) -> Any:
    """``out`` (a tensor, a tuple of them, or None) copied: a chain may return a buffer it reuses."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return tuple(_snapshot(o) for o in out)
    return out


def _same_bits(a: Any, b: Any) -> bool:
    """Whether two chain results hold the same bits (-0.0 and NaN payloads included)."""
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(map(_same_bits, a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype.is_floating_point:
            width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
            return torch.equal(a.contiguous().view(width), b.contiguous().view(width))
        return torch.equal(a, b)
    return a is b or a == b


#: Below this many elements the eager codecs run: a compiled call costs tens of microseconds
#: more, and tiny sizes would each compile a graph of their own (sizes 0 and 1 specialize).
MIN_NUMEL = 1 << 16


def _applies(t: torch.Tensor, n: int | None = None) -> bool:
    """Whether a chain serves ``t`` (of ``n`` elements, default its own): on, CPU or CUDA, not tiny."""
    return _enabled and t.device.type in ("cpu", "cuda") and (t.numel() if n is None else n) >= MIN_NUMEL


# -- bit packing inside a chain ---------------------------------------------------------------


#: moves the 8 bytes of an int64 (0 or 1 each) to the bits of its top byte
_GATHER = gather_multiplier(1)


def _pack_bits(votes: torch.Tensor) -> torch.Tensor:
    """Bool ``votes`` (a multiple of 8) as bytes, element ``i`` at bit ``i % 8`` (``bits.pack``'s
    layout), by the eager packer's multiply (:func:`.bits.pack_bytes_into_lanes`): the votes
    as 0/1 bytes, eight of them read as one int64, times :data:`_GATHER`, the top byte. The
    bytes go through int32 (inductor's CPU code converts bool to uint8 element by element,
    ~20x slower), and the multiply is ~5x faster there than ORing eight strided columns."""
    word = torch.where(votes, 1, 0).to(torch.uint8).view(torch.int64) * _GATHER
    return (word >> 56).to(torch.uint8)


def _tail_byte(votes: torch.Tensor) -> torch.Tensor:
    """The last, partial byte of fewer than 8 bool ``votes`` (eager: a few elements; the bit
    weights made on the device, not copied from the host: no sync on CUDA)."""
    weights = torch.bitwise_left_shift(1, torch.arange(votes.numel(), dtype=torch.int32, device=votes.device))
    return (votes.to(torch.int32) * weights).sum().to(torch.uint8).view(1)


# -- L_p quantization (Lion Cub Eq. 1) ---------------------------------------------------------

#: per device, a float32 buffer as long as the longest input so far, for ``|x|`` (a fresh
#: full-size tensor per call costs a page fault per 4 KiB: torch's CPU allocator does not cache)
_MAGNITUDES: dict[torch.device, torch.Tensor] = {}


def _magnitudes(n: int, device: torch.device) -> torch.Tensor:
    buf = _MAGNITUDES.get(device)
    if buf is None or buf.numel() < n:
        buf = _MAGNITUDES[device] = torch.empty(n, dtype=torch.float32, device=device)
    return buf[:n]


def lp_quantize(
    x: torch.Tensor,
    levels: int,
    p: float,
    validate: bool,
    lp_norm_mean: Callable[[torch.Tensor, float], torch.Tensor],
    all_finite: Callable[[torch.Tensor], bool],
) -> torch.Tensor | None:
    """:func:`.lp.lp_quantize_levels` of a non-empty float ``x`` (``levels`` checked), given
    that module's ``lp_norm_mean`` and ``all_finite`` (passed in: codecs import this module,
    not the other way): the same checks in the same order, errors, mean and codes.

    For p = 1 one compiled pass writes ``float32(|x|)`` into a reused buffer and the mean is
    the eager ``mean()`` of those same values; it also stands in for the NaN/Inf scan, as
    ``all_finite``'s sum does (a sum of magnitudes is finite only if every one is; when it is
    not, the exact eager scan decides). Other p take the eager scan and mean (which checks
    ``p``). Then ``(float32(x) · scale).round().clamp(-levels, levels)`` compiled."""
    if not _applies(x) or not x.dtype.is_floating_point:
        return None
    flat = x.detach().reshape(-1)
    if p != 1.0 and validate and not all_finite(flat):
        raise ValueError("lp_quantize: input contains NaN or Inf; refusing to quantize it")
    if p == 1.0:

        def build_magnitudes():
            def magnitude_chain(v, out):
                out.copy_(v.abs().float())

            return magnitude_chain

        mag = _magnitudes(flat.numel(), flat.device)
        if "lp_quantize |x|" in _failed:
            return None
        _run("lp_quantize |x|", (flat.dtype,), build_magnitudes, flat, mag)
        if "lp_quantize |x|" in _failed:
            return None
        mean = mag.mean()  # = x.abs().float().mean(): the same values, the same reduction
        if validate and not bool(torch.isfinite(mean)) and not all_finite(flat):
            raise ValueError("lp_quantize: input contains NaN or Inf; refusing to quantize it")
        m = mean.double()
    else:
        m = lp_norm_mean(x, p)
    out_dtype = torch.int8 if levels <= 127 else torch.int16
    scale = torch.where(m > 0, levels / (2.0 * m.clamp_min(torch.finfo(torch.float64).tiny)), torch.zeros_like(m))

    def build():
        def lp_chain(v, s):
            return (v.float() * s).round().clamp(-levels, levels).to(out_dtype)

        return lp_chain

    codes = _run("lp_quantize", (levels, out_dtype, x.dtype), build, flat, scale.float())
    return None if codes is None else codes.view(x.shape)


# -- 1-bit Adam / LAMB: signs and error feedback -----------------------------------------------


def signs_and_error(v: torch.Tensor, scale: torch.Tensor, nbytes: int) -> torch.Tensor | None:
    """The packed sign bits (``v >= 0``, ``nbytes`` bytes, zero-padded) of 1-D float32 ``v``,
    and ``v`` ← ``v − s·sign(v)`` in place. ``s·sign`` is exact (±s), so one rounding per
    element, as eager's ``addcmul_``."""
    if not _applies(v):
        return None
    n = v.numel()
    whole = n // 8 * 8
    out = torch.zeros(nbytes, dtype=torch.uint8, device=v.device)

    def build():
        def compress_chain(part, s):
            positive = part >= 0
            part.copy_(part - torch.where(positive, s, -s))
            return _pack_bits(positive)

        return compress_chain

    if whole:
        bits = _run("scaled_sign_compress", (), build, v[:whole], scale)
        if bits is None:
            return None
        out[: whole // 8] = bits
    if whole < n:
        rest = v[whole:]
        positive = rest >= 0
        out[whole // 8] = _tail_byte(positive)[0]
        rest.addcmul_(positive.to(torch.int8).mul_(2).sub_(1), scale, value=-1)
    return out


# -- BitDP 2-bit ternary codes -------------------------------------------------------------------


def channel_ternary(
    rows: torch.Tensor,
    factor: float,
    mean_abs_sliced: Callable[[torch.Tensor], torch.Tensor],
    scales: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """BitDP's 2-bit ``(codes, scales)`` of float32 ``rows`` (r, c), as
    :func:`.channel.channel_encode` returns them, given that module's threshold factor, row
    means on slices and Eq. 4 scales (passed in: codecs import this module, not the other
    way). The row means ``mean|g|`` (for the threshold) and the kept sums are eager
    reductions, each called on whole rows as the eager encoder calls them; one compiled pass
    between them writes the codes, the count of kept entries per row (an exact integer sum)
    and ``|g|`` where kept (+0 elsewhere)."""
    if not _applies(rows):
        return None
    rows = rows.detach()
    mean_abs = mean_abs_sliced(rows) if sliced(rows) else rows.abs().mean(dim=1)
    alpha = (factor * mean_abs).unsqueeze(1)

    def build():
        def ternary_chain(g, a):
            plus = g >= a
            minus = g < -a
            kept = plus | minus
            codes = (torch.where(plus, 1, 0) + torch.where(minus, 2, 0)).to(torch.uint8)
            return codes, torch.where(kept, 1, 0).sum(1, dtype=torch.int32), torch.where(kept, g.abs(), 0.0)

        return ternary_chain

    got = _run("channel_encode", (), build, rows, alpha)
    if got is None:
        return None
    codes, kept_count, kept = got
    return codes.reshape(-1), scales(kept_count, kept.sum(dim=1))
