"""Measure the link the ranks actually share: α (latency) and β (inverse bandwidth) from a
few timed collectives, fitted by least squares, agreed by every rank.

Why: every ``auto`` plan (Lion Cub's mode, TurboQuant's and BitDP's forms) weighs the α–β
wire time of its candidates; planned for a link that is not there, it compresses on a
100 Gbit/s cluster for nothing, or sends fp32 over 100 Mbit/s. ``link_bandwidth_gbps:
measure`` (the default) resolves the link here, at attach (:func:`resolve_config`).

**The probe** (:func:`probe`), a collective every rank of ``group`` runs at once:

* ring allreduces of 4 KiB, 64 KiB, 1 MiB and 16 MiB (capped at 256 MiB/P), each
  size timed ``repeat`` times (median) after one warm-up call, over ``over`` — on a
  hierarchical topology the cross-node group of this local rank, so the L local ranks of a
  node probe its link together, as the hierarchical form uses it;
* after each size the ranks agree the slowest rank's time (a MAX allreduce over ``group``)
  and, all alike, stop before a size predicted to overrun the time budget (2 s by default;
  about 0.3 s on a 100 Mbit/s link, 0.1 s on loopback): the number of transfers is bounded
  (at most 4 sizes × (repeat + 1) collectives plus 4 small allreduces);
* :func:`fit_alpha_beta` fits ``t = rounds·α + 8·x/bandwidth`` to the agreed points, x the
  bytes one rank sends (2(P-1)/P·size), ``rounds`` = 2⌈log2 P⌉ as :mod:`.flat` counts
  an allreduce's latency.

Why allreduces: on an emulated 100 Mbit/s link (``benchmarks/harness/netem.py``) gloo's ring allreduce
moved 89-90 Mbit/s per rank at 1 and 4 MiB, its all-gather of the same bytes 63-66 Mbit/s; the
allreduce figure is the link's (within 13 % of the shaped rate, which counts headers too), and
DDP's step time predicted from it fell within 8 % of the
measured one. ``kind="all_gather"`` / ``"all_to_all"`` time those collectives instead
(``lowbit-plan --measure`` reports all three).

The figure is what one rank's collective gets while every rank sends at once: the
bandwidth the planners' per-rank formulas divide by.

``LOWBIT_LINK_ASSUME="GBPS,US"`` resolves ``measure`` to those figures without a probe
(reproducible runs; the test suite pins the link that way).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lowbit_strategy.collectives import group as g
from lowbit_strategy.validation import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["ASSUME_ENV", "MEASURE", "LinkFit", "fit_alpha_beta", "needs_link", "probe", "resolve_config"]

#: the value of ``link_bandwidth_gbps`` / ``link_latency_us`` that asks for a probe
MEASURE = "measure"
#: environment variable: ``"GBPS,US"`` figures that ``measure`` resolves to without a probe
ASSUME_ENV = "LOWBIT_LINK_ASSUME"
#: what ``measure`` means where nothing is measured (one rank, or a plan made outside a
#: run): the figures the fields defaulted to before ``measure``
FALLBACK_GBPS, FALLBACK_US = 1.0, 50.0
#: bytes per rank of the probe's collectives, ascending
SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
#: the most a probe's output (an all-gather's: P times the size) may hold, in bytes
MAX_OUTPUT = 256 << 20
#: the fastest link a fit may report (a loopback's β can fit as ~0: "no measurable limit")
MAX_GBPS = 10_000.0


@dataclass(frozen=True)
class LinkFit:
    """A fitted link: ``latency_us`` (α), ``bandwidth_gbps`` (8/β), the agreed points
    ``(bytes per rank, seconds)`` and the probe's wall seconds."""

    latency_us: float
    bandwidth_gbps: float
    points: tuple[tuple[int, float], ...] = ()
    seconds: float = 0.0


def _rounds(p: int) -> int:
    return math.ceil(math.log2(p)) if p > 1 else 1


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float], rounds: int = 1) -> tuple[float, float]:
    """Least-squares ``t = rounds·α + x·β`` through the points ``(nbytes[i], seconds[i])``;
    returns ``(α in seconds, bandwidth in bit/s)``. α is clamped at 0; a slope that is not
    positive (the link too fast to see at these sizes) reads as :data:`MAX_GBPS`. Raises
    ``ValueError`` for fewer than two distinct sizes."""
    xs, ts = [float(x) for x in nbytes], [float(t) for t in seconds]
    if len(xs) != len(ts) or len(set(xs)) < 2:
        raise ValueError(f"fit_alpha_beta needs >= 2 distinct sizes with one time each, got {xs} and {ts}")
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / sxx
    intercept = mt - slope * mx
    if slope <= 0:  # no bandwidth term visible: the largest transfer bounds the link from below
        slope = 8 / (MAX_GBPS * 1e9)
    return max(0.0, intercept) / max(1, rounds), 8 / slope


def _timed(fn, repeat: int, cuda: bool) -> float:
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe(
    group=None,
    over=None,
    device: torch.device | str = "cpu",
    budget_s: float = 2.0,
    repeat: int = 3,
    sizes: Sequence[int] = SIZES,
    kind: str = "all_reduce",
) -> LinkFit:
    """Fit α and β of the link between the ranks of ``over`` (default ``group``) by timed
    allreduces (module docstring), ``kind="all_gather"`` (``size`` bytes from each rank,
    ⌈log2 P⌉ rounds) or ``kind="all_to_all"`` (``size`` bytes to each peer, P - 1 rounds);
    a collective over ``group``, which every rank of it calls at once with the same
    arguments, and every rank returns the same :class:`LinkFit`."""
    if kind not in ("all_reduce", "all_gather", "all_to_all"):
        raise ValueError(f"probe kind: got {kind!r}; use 'all_reduce', 'all_gather' or 'all_to_all'")
    started = time.perf_counter()
    device = torch.device(device)
    cuda = device.type == "cuda"
    over = group if over is None else over
    p = g.world_size(over)
    if p <= 1:
        return LinkFit(FALLBACK_US, FALLBACK_GBPS)
    points: list[tuple[int, float]] = []
    spent = 0.0
    for i, size in enumerate(s for s in sizes if s * p <= MAX_OUTPUT):
        chunk = max(1, size // 4)
        inp = torch.zeros(chunk * (p if kind == "all_to_all" else 1), dtype=torch.float32, device=device)
        out = torch.empty(chunk * p if kind != "all_reduce" else 1, dtype=torch.float32, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def call(inp=inp, out=out, gather=gather):
            if kind == "all_reduce":
                dist.all_reduce(inp, group=over)
            elif kind == "all_to_all":
                dist.all_to_all_single(out, inp, group=over)
            else:
                gather(out, inp, group=over)

        if i == 0:
            call()  # warm-up: connections, buffers
        mine = torch.tensor([_timed(call, repeat, cuda)], dtype=torch.float64, device=device)
        g.all_reduce_max(mine, group, "link.probe")
        seconds = float(mine.item())
        sent = 2 * (p - 1) * chunk * 4 // p if kind == "all_reduce" else (p - 1) * chunk * 4
        points.append((sent, seconds))
        spent += seconds * (repeat + (i == 0))
        # every rank holds the same agreed figures, so every rank stops at the same size
        if spent + 16 * seconds * (repeat + 1) > budget_s:
            break
    if len(points) < 2:  # even the smallest size overran the budget: a latency-free bound
        ((x, t),) = points
        return LinkFit(0.0, min(MAX_GBPS, 8 * x / t / 1e9), tuple(points), time.perf_counter() - started)
    rounds = {"all_to_all": p - 1, "all_gather": _rounds(p), "all_reduce": 2 * _rounds(p)}[kind]
    alpha, bps = fit_alpha_beta([x for x, _ in points], [t for _, t in points], rounds)
    return LinkFit(alpha * 1e6, min(MAX_GBPS, bps / 1e9), tuple(points), time.perf_counter() - started)


def needs_link(config) -> bool:
    """Whether the active algorithm plans with the link: an ``auto`` mode or form."""
    section = config.section
    return MEASURE in (config.link_bandwidth_gbps, config.link_latency_us) and "auto" in (
        getattr(section, "mode", None),
        getattr(section, "form", None),
    )


def assumed(environ=None) -> tuple[float, float] | None:
    """``(gbps, us)`` from :data:`ASSUME_ENV`, or None when unset; a malformed value raises
    :class:`ConfigError` naming the variable."""
    value = (os.environ if environ is None else environ).get(ASSUME_ENV, "").strip()
    if not value:
        return None
    try:
        gbps, us = (float(v) for v in value.split(","))
    except ValueError:
        gbps = us = -1.0
    if not (gbps > 0 and us >= 0 and math.isfinite(gbps) and math.isfinite(us)):
        raise ConfigError(
            "link_bandwidth_gbps", value, f"{ASSUME_ENV} must be 'GBPS,US' (e.g. '25,20'), bandwidth > 0, latency >= 0"
        )
    return gbps, us


def resolve_config(config, group=None, topology=None, device: torch.device | str = "cpu"):
    """``config`` with ``measure`` replaced by figures (a collective over ``group`` when it
    probes): those of :data:`ASSUME_ENV` if set, else the probe's over the cross-node groups
    of a hierarchical ``topology`` (else over ``group``), logged once by rank 0. Returned
    unchanged when no ``auto`` reads the link or there is one rank: nothing probes then."""
    if not needs_link(config) or g.world_size(group) <= 1:
        return config
    pinned = assumed()
    if pinned is not None:
        fit = LinkFit(pinned[1], pinned[0])
        how = f"from {ASSUME_ENV}"
    else:
        over = topology.inter if topology is not None and topology.hierarchical else group
        fit = probe(group, over, device)
        how = f"measured in {fit.seconds:.2f} s over {len(fit.points)} sizes"
    changes = {}
    if config.link_bandwidth_gbps == MEASURE:
        changes["link_bandwidth_gbps"] = fit.bandwidth_gbps
    if config.link_latency_us == MEASURE:
        changes["link_latency_us"] = fit.latency_us
    if g.rank(group) == 0:
        logger.info("lowbit: link %.3g Gbit/s, latency %.0f us (%s)", fit.bandwidth_gbps, fit.latency_us, how)
    return config.replace(**changes)
