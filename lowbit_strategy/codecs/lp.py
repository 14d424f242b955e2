"""L_p quantization Q_p of Lion Cub (Eq. 1).

    Q_p(x)_i = clamp(round(L / (2 M_p(x)) * x_i), L),     L = 2**(bits-1) - 1
    M_p(x)   = (mean_j |x_j|**p) ** (1/p)

Normalizing by the L_p mean instead of the maximum (p = inf, the usual quantizer) makes
the codes robust to the outliers of Lion's heavy-tailed update vectors (Sec. 4.1): with
p = 1 most entries keep a non-zero code, and the few huge ones saturate at ±L.

Supported p: 0, 1, 2 and inf.

* p = 0 is the limit p -> 0, the geometric mean exp(mean log|x_j|). That limit is 0 as
  soon as one entry is exactly zero, which would saturate every other code; we take the
  geometric mean over the *non-zero* entries instead (documented deviation).
* Zero input is safe: when M_p(x) = 0 (all entries zero) every code is 0.
* ``round`` is round-half-to-even (``torch.round``), a deterministic tie rule.

* Range: codes follow Eq. 1 while M_p(x) is a normal float32 and the scale L / 2M_p is a
  finite one, i.e. M_p >= max(1.2e-38, L * 1.5e-39) (4.8e-35 at 16 bits). Below that (all
  entries near float32's underflow, far under any real gradient or update) the scale
  overflows and the p = 1 mean may underflow; codes then still keep each entry's sign,
  order and the range [-L, L], but not Eq. 1's values. Checking for this would cost a
  host sync per call.

Codes are int8 for bits <= 8 and int16 for bits <= 16. Quantization is scale invariant:
Q_p(c·x) = Q_p(x) for any c > 0 (exactly so for powers of two).
"""

from __future__ import annotations

import math

import torch

from lowbit_strategy.codecs import compiled
from lowbit_strategy.codecs.streaming import SLICE, sliced, slices
from lowbit_strategy.validation import check_int

SUPPORTED_P = (0.0, 1.0, 2.0, math.inf)


def levels_for_bits(bits: int) -> int:
    """The largest code magnitude L = 2**(bits-1) - 1 of a signed ``bits``-bit code."""
    check_int("levels_for_bits", "bits", bits, 2, 16, what=" (L = 2**(bits-1) - 1 >= 1)")
    return 2 ** (bits - 1) - 1


def _check_p(p: float) -> float:
    try:
        pf = float(p)
    except (TypeError, ValueError):
        raise ValueError(f"p must be one of 0, 1, 2, inf, got {p!r}") from None
    if pf not in SUPPORTED_P:
        raise ValueError(f"p must be one of 0, 1, 2, inf, got {p!r}")
    return pf


def _check_input(x: torch.Tensor, validate: bool) -> None:
    if not x.dtype.is_floating_point:
        raise TypeError(f"lp_quantize needs a floating-point tensor, got dtype {x.dtype}")
    if x.numel() == 0:
        raise ValueError("lp_quantize got an empty tensor")
    if validate and not all_finite(x):
        raise ValueError("lp_quantize: input contains NaN or Inf; refusing to quantize it")


def all_finite(x: torch.Tensor) -> bool:
    """Whether no entry of the non-empty float ``x`` is NaN or ±Inf (one host sync, two if
    the sum overflows or the input is not finite).

    A finite sum proves every entry finite: an infinity or a NaN anywhere makes every
    partial sum that holds it, and so the total, infinite or NaN. One streaming reduction
    decides the common case; only a non-finite sum (a real NaN/Inf, or finite values whose
    sum overflows) pays for the exact test, max and min, which propagate NaN and are ±Inf
    exactly when an infinity is present (no n-byte mask: ``isfinite(x).all()`` is ~15x slower
    on CPU).
    """
    if bool(torch.isfinite(x.sum())):
        return True
    return bool(torch.isfinite(torch.stack([x.amax(), x.amin()])).all())


def lp_norm_mean(x: torch.Tensor, p: float = 1.0) -> torch.Tensor:
    """M_p(x), the power mean of |x| (0-dim float64 tensor); see the module docstring.

    p = 1 and p = inf are exact enough in float32 (a mean and a max); p = 2 and p = 0 are
    accumulated in float64, since Lion's update entries reach 1e-12 and below (Lion Cub
    Sec. 4.1), whose squares underflow float32.
    """
    p = _check_p(p)
    if p == math.inf:  # max |x| from one min-max pass, no |x| buffer (the same value: exact)
        low, high = torch.aminmax(x.detach())
        return torch.maximum(low.abs(), high.abs()).double()
    if p == 1.0:
        return x.detach().abs().float().mean().double()
    a = x.detach().abs().reshape(-1)  # a fresh tensor: the in-place steps below are safe
    if p == 2.0:
        return a.double().square_().mean().sqrt()
    return _geometric_mean_nonzero(a)


def _geometric_mean_nonzero(a: torch.Tensor) -> torch.Tensor:
    """exp(mean log a_j) over the entries a_j > 0 of the 1-D magnitudes ``a``, in float64.

    The same float64 log, mean and exp as a plain ``a.double()[a > 0].log().mean().exp()``
    (so bit-for-bit the same value), but cheaper: the selection runs on ``a``'s own dtype
    before widening (:func:`_positive_entries`), and the log is taken in place instead of
    into another float64 buffer.
    """
    kept = _positive_entries(a)
    if kept.numel() == 0:
        return torch.zeros((), dtype=torch.float64, device=a.device)
    return kept.double().log_().mean().exp()  # .double() of float64 |x| is our own copy too


#: Up to this many dropped entries, :func:`_positive_entries` copies the runs between them.
_FEW_DROPPED = 1024


def _positive_entries(a: torch.Tensor) -> torch.Tensor:
    """The entries of 1-D ``a`` that are > 0, in order (``a[a > 0]``, same values).

    A boolean-mask gather costs ~50x a streaming pass on CPU, so: no selection when the
    minimum is positive (the usual case for gradients; a NaN minimum is not), and when
    only a few entries drop out, the runs between them are concatenated.
    """
    if bool(a.amin() > 0):
        return a
    dropped = (a > 0).logical_not_().nonzero().squeeze(1)
    if dropped.numel() > _FEW_DROPPED:
        return a[a > 0]
    bounds = [-1, *dropped.tolist(), a.numel()]
    runs = [a[lo + 1 : hi] for lo, hi in zip(bounds, bounds[1:]) if hi > lo + 1]
    return torch.cat(runs) if runs else a[:0]


def lp_quantize_levels(x: torch.Tensor, levels: int, p: float = 1.0, *, validate: bool = True) -> torch.Tensor:
    """Q_p with an explicit code range [-levels, levels] (Eq. 1 with L = ``levels``).

    The summed allreduce picks ``levels`` from the world size and lane width, which need
    not be of the form 2**(bits-1) - 1. ``validate=False`` skips the NaN/Inf scan (one
    host sync) for callers that have excluded non-finite input already; nothing else
    here waits for the device.
    """
    check_int("lp_quantize_levels", "levels", levels, 1, 2**15 - 1)
    if compiled.compiled_enabled():  # opt-in: the same codes, compiled (compiled.py)
        codes = compiled.lp_quantize(x, levels, p, validate, lp_norm_mean, all_finite)
        if codes is not None:
            return codes
    _check_input(x, validate)
    m = lp_norm_mean(x, p)
    out_dtype = torch.int8 if levels <= 127 else torch.int16
    # M_p = 0 only for an all-zero input: scale 0 then gives all-zero codes (no branch,
    # so no host sync per call)
    scale = torch.where(m > 0, levels / (2.0 * m.clamp_min(torch.finfo(torch.float64).tiny)), torch.zeros_like(m))
    if not sliced(x):
        codes = x.float() * scale.float()
        return codes.round_().clamp_(-levels, levels).to(out_dtype)
    return _quantize_sliced(x, scale.float(), levels, out_dtype)


def lp_quantize_many(
    xs: list[torch.Tensor], levels: int, p: float = 1.0, *, batched: bool | None = None
) -> torch.Tensor:
    """``torch.cat([lp_quantize_levels(x.reshape(-1), levels, p, validate=False) for x in xs])``:
    a bucket's codes, each tensor with its own scale (Lion Cub quantizes each update vector
    against its own M_p, Eq. 1), bit for bit that.

    ``batched`` (default: on a GPU) quantizes the bucket in one chain instead of one per
    tensor: each tensor's M_p as before (the same reduction, so the same scale), the scales
    formed together, then one multiply of the concatenated entries by each entry's scale (the
    same float32 product as by a 0-d scale), one rounding, one clamp and one cast for the
    bucket. On a GPU the per-tensor chains were ~13 launches per tensor, host-bound (the
    one-GPU check, part 4); batched it is 3 per tensor plus ~12 for the bucket (each entry's
    scale an expanded view, concatenated: nothing read from or copied by the host). On the CPU
    the per-tensor chains stream each tensor slice by slice (:func:`_quantize_sliced`), which
    the batched form's bucket-sized temporaries would not."""
    check_int("lp_quantize_many", "levels", levels, 1, 2**15 - 1)
    flat = [x.reshape(-1) for x in xs]
    if batched is None:
        batched = bool(flat) and flat[0].device.type != "cpu" and not compiled.compiled_enabled()
    if not batched or len(flat) < 2:
        return torch.cat([lp_quantize_levels(x, levels, p, validate=False) for x in flat])
    means = torch.stack([lp_norm_mean(x, p) for x in flat])
    # lp_quantize_levels' scale, elementwise over the bucket's tensors: the same float64 ops
    scales = torch.where(
        means > 0, levels / (2.0 * means.clamp_min(torch.finfo(torch.float64).tiny)), torch.zeros_like(means)
    ).float()
    # each entry's scale: expanded views, one concatenation (no host-to-device copy of sizes)
    per_entry = torch.cat([s.expand(x.numel()) for s, x in zip(scales.unbind(), flat)])
    codes = torch.cat(flat).float().mul_(per_entry)  # float32(x) · scale, as x.float() * scale.float()
    return codes.round_().clamp_(-levels, levels).to(torch.int8 if levels <= 127 else torch.int16)


def _quantize_sliced(x: torch.Tensor, scale: torch.Tensor, levels: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``(float32(x) · scale).round_().clamp_(-levels, levels).to(out_dtype)`` slice by slice
    through one reused float32 buffer (:mod:`.streaming`): the same elementwise operations,
    so the same codes, in one pass over ``x`` and one over the codes."""
    flat = x.detach().reshape(-1)  # out= below: no autograd graph (codes have no gradient)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    codes = out.view(-1)
    buf = torch.empty(min(SLICE, flat.numel()), dtype=torch.float32, device=x.device)
    for start, stop in slices(flat.numel()):
        t = buf[: stop - start]
        if flat.dtype == torch.float32:
            torch.mul(flat[start:stop], scale, out=t)
        else:  # float32(x) first, exactly as x.float() rounds it
            t.copy_(flat[start:stop]).mul_(scale)
        codes[start:stop].copy_(t.round_().clamp_(-levels, levels))
    return out


def lp_quantize(x: torch.Tensor, bits: int, p: float = 1.0) -> torch.Tensor:
    """Q_p(x) with ``bits``-bit signed codes in [-L, L], L = 2**(bits-1) - 1 (Lion Cub Eq. 1).

    Returns int8 codes for bits <= 8, int16 for bits <= 16, of ``x``'s shape.
    """
    return lp_quantize_levels(x, levels_for_bits(bits), p)
