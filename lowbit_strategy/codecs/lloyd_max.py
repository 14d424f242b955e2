"""Lloyd–Max codebooks for the standard normal N(0, 1): the levels of the TurboQuant codec.

"TurboQuant-Adam" rotates each tensor with a randomized Walsh–Hadamard transform
(:mod:`.hadamard`), after which its coordinates are close to Gaussian, and quantizes them
with the MSE-optimal scalar quantizer for N(0, 1) scaled by the tensor's scale. That
quantizer is the fixed point of the Lloyd–Max iteration (Lloyd, "Least Squares
Quantization in PCM"; Max, "Quantizing for Minimum Distortion"):

* thresholds ``t_i = (l_i + l_{i+1}) / 2`` (midpoints of neighbouring levels, ``t_0 = -inf``,
  ``t_L = +inf``);
* levels ``l_i = E[Z | t_{i-1} < Z <= t_i] = (φ(t_{i-1}) - φ(t_i)) / (Φ(t_i) - Φ(t_{i-1}))``
  (conditional means of N(0, 1) between the thresholds, φ/Φ its pdf/cdf).

Computation: in float64 with :func:`math.erf` / :func:`math.erfc`, on the positive half
only (the codebook is symmetric; ``2**bits`` levels, none at 0), cell probabilities as
differences of ``erfc`` so the far tail keeps its precision. Starts from the conditional
means of equal-probability cells and alternates the two steps until no level moves by more
than ``1e-12`` (at most 200 000 rounds; reaching the cap raises ``RuntimeError``, which
does not happen for 2..8 bits; the slowest mode of the iteration needs ~100 000 rounds
at 8 bits, about 8 s of pure Python, milliseconds up to 5 bits). Then the levels are
symmetrized exactly and rounded once to float32.

The codecs read the solver's float64 results from :mod:`.lloyd_max_table` (written by
``python -m lowbit_strategy.codecs.lloyd_max``; the tests recompute every width and require
the same floats), so no process pays the 8-bit solve at start-up.

Results are cached per ``bits`` (:func:`functools.cache` over an immutable tuple);
:func:`lloyd_max_codebook` returns a fresh tensor on every call, so a caller writing into
it cannot change what the next caller gets.

Known values (Max 1960): 2 bits: ``±0.4528, ±1.510``, MSE 0.1175; 4 bits: MSE 0.009497
(of the unit variance). :func:`lloyd_max_mse` gives the MSE of a codebook for N(0, 1).
"""

from __future__ import annotations

import functools
import math

import torch

from lowbit_strategy.codecs.lloyd_max_table import HALF_LEVELS
from lowbit_strategy.validation import check_int

#: supported code widths
CODEBOOK_BITS = tuple(range(2, 9))

_TOL = 1e-12
_MAX_ROUNDS = 200_000
_SQRT2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def check_bits(cls: str, bits, *, what: str = "") -> int:
    """``bits`` if it is one of :data:`CODEBOOK_BITS` (an int in [2, 8]), else a ``ValueError``
    naming ``cls``: the one rule for a TurboQuant code width, wherever it enters (codebook,
    codec, optimizer, layers), since every width needs its codebook here."""
    return check_int(cls, "bits", bits, CODEBOOK_BITS[0], CODEBOOK_BITS[-1], what=what)


def _pdf(t: float) -> float:
    return 0.0 if math.isinf(t) else _INV_SQRT_2PI * math.exp(-0.5 * t * t)


def _upper_tail(t: float) -> float:
    """P(Z > t) for t >= 0, accurate in the far tail."""
    return 0.0 if math.isinf(t) else 0.5 * math.erfc(t / _SQRT2)


def _half_levels(bits: int) -> tuple[float, ...]:
    """The positive levels (ascending) of the 2**bits-level Lloyd–Max quantizer of N(0, 1)."""
    m = 2 ** (bits - 1)  # positive levels; the negative ones mirror them, 0 is a threshold
    # start: the asymptotically optimal point density ∝ φ^(1/3) (Panter–Dite), i.e. cells of
    # equal probability under N(0, 3): thresholds sqrt(3)·t with P(Z > t) = (m - i) / (2m)
    bounds = [0.0]
    for i in range(1, m):
        p = (m - i) / (2 * m)
        lo, hi = 0.0, 10.0  # invert the upper tail by bisection (start only, precision irrelevant)
        for _ in range(60):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if _upper_tail(mid) > p else (lo, mid)
        bounds.append(math.sqrt(3.0) * 0.5 * (lo + hi))
    bounds.append(math.inf)
    prev = None
    for _ in range(_MAX_ROUNDS):
        levels = [(_pdf(a) - _pdf(b)) / (_upper_tail(a) - _upper_tail(b)) for a, b in zip(bounds, bounds[1:])]
        if prev is not None and max(abs(a - b) for a, b in zip(levels, prev)) <= _TOL:
            return tuple(levels)
        prev = levels
        bounds = [0.0] + [0.5 * (a + b) for a, b in zip(levels, levels[1:])] + [math.inf]
    raise RuntimeError(f"Lloyd–Max iteration for bits={bits} did not converge in {_MAX_ROUNDS} rounds")


@functools.cache
def _codebook(bits: int) -> tuple[float, ...]:
    half = HALF_LEVELS[bits]  # _half_levels(bits), precomputed
    return tuple(-v for v in reversed(half)) + half


def lloyd_max_codebook(bits: int) -> torch.Tensor:
    """The ``2**bits`` Lloyd–Max levels for N(0, 1), ascending, as a fresh float32 CPU tensor.

    ``bits`` is an int in 2..8 (``ValueError`` naming ``bits`` otherwise). Symmetric:
    ``levels[i] == -levels[-1 - i]`` exactly.
    """
    return torch.tensor(_codebook(check_bits("lloyd_max_codebook", bits)), dtype=torch.float32)


def lloyd_max_mse(levels) -> float:
    """The mean squared error of nearest-level quantization of N(0, 1) with ``levels``.

    ``levels``: ascending floats (a tensor or a sequence). Exact integral in float64 over
    the cells between midpoints: ``Σ_i E[(Z - l_i)² ; cell i]``.
    """
    lv = [float(v) for v in (levels.tolist() if isinstance(levels, torch.Tensor) else levels)]
    bounds = [-math.inf] + [0.5 * (a + b) for a, b in zip(lv, lv[1:])] + [math.inf]

    def cdf(t: float) -> float:
        return 0.5 * math.erfc(-t / _SQRT2)

    def partial_second(t: float) -> float:  # ∫_{-inf}^t z² φ(z) dz = Φ(t) - t φ(t)
        return cdf(t) - (0.0 if math.isinf(t) else t * _pdf(t))

    total = 0.0
    for lvl, a, b in zip(lv, bounds, bounds[1:]):
        p = cdf(b) - cdf(a)
        first = _pdf(a) - _pdf(b)  # ∫ z φ
        second = partial_second(b) - partial_second(a)
        total += second - 2.0 * lvl * first + lvl * lvl * p
    return total


_TABLE_HEAD = '''"""The positive Lloyd–Max levels of N(0, 1) for 2-8 bits, as :func:`.lloyd_max._half_levels`
computes them in float64 (``float.hex``: exact). Generated by
``python -m lowbit_strategy.codecs.lloyd_max``; ``tests/codecs/test_lloyd_max.py`` recomputes
them with the solver and requires the same floats bit for bit (slow tier: ~10 s at 8 bits).

Why a table: the 8-bit solve takes ~100,000 rounds of pure Python, about 8 s once per
process, and every rank of a TurboQuant job with 8-bit codes paid it at start-up."""

from __future__ import annotations

'''


def table_source() -> str:
    """The source of :mod:`.lloyd_max_table`: :func:`_half_levels` for every width, as exact hex."""
    body = ["HALF_LEVELS: dict[int, tuple[float, ...]] = {"]
    for bits in CODEBOOK_BITS:
        body += [f"    {bits}: tuple(", "        float.fromhex(x)", "        for x in ("]
        body += [f'            "{v.hex()}",' for v in _half_levels(bits)]
        body += ["        )", "    ),"]
    return _TABLE_HEAD + "\n".join(body + ["}"]) + "\n"


if __name__ == "__main__":  # rewrite the table from the solver (about 10 s)
    source = table_source()
    path = __file__.replace("lloyd_max.py", "lloyd_max_table.py")
    with open(path, "w") as f:
        f.write(source)
    print(f"wrote {path}")
