"""``link_bandwidth_gbps: measure``: the α–β fit, the config field, and the probe at attach on
real gloo ranks (the same figure on every rank, reaching the algorithms' ``auto``)."""
import io
import json
import os
import random
from contextlib import redirect_stdout

import pytest
import torch
import torch.distributed as dist

from lowbit_strategy.pricing import link_probe
from lowbit_strategy.config import ConfigError, LowBitConfig
from tests.distributed import run_ranks


@pytest.mark.parametrize(("alpha_us", "gbps", "rounds"), [(50.0, 1.0, 1), (5.0, 100.0, 3), (2000.0, 0.1, 1)])
def test_fit_recovers_alpha_and_beta(alpha_us, gbps, rounds):
    sizes = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
    times = [rounds * alpha_us * 1e-6 + 8 * x / (gbps * 1e9) for x in sizes]
    alpha, bps = link_probe.fit_alpha_beta(sizes, times, rounds)
    assert alpha == pytest.approx(alpha_us * 1e-6, rel=1e-6, abs=1e-12)
    assert bps == pytest.approx(gbps * 1e9, rel=1e-9)
    rng = random.Random(0)  # 2 % noise on every time: still within a few percent
    noisy = [t * (1 + rng.uniform(-0.02, 0.02)) for t in times]
    assert link_probe.fit_alpha_beta(sizes, noisy, rounds)[1] == pytest.approx(gbps * 1e9, rel=0.05)


def test_fit_edge_cases():
    # a link too fast to see at these sizes: no bandwidth term, reported as the cap
    assert link_probe.fit_alpha_beta([1, 2], [1e-3, 1e-3])[1] == pytest.approx(link_probe.MAX_GBPS * 1e9)
    with pytest.raises(ValueError, match="2 distinct sizes"):
        link_probe.fit_alpha_beta([1, 1], [1.0, 2.0])


def test_config_measure_field():
    assert LowBitConfig().link_bandwidth_gbps == "measure" and LowBitConfig().link_latency_us == "measure"
    assert LowBitConfig(link_bandwidth_gbps="MEASURE").link_bandwidth_gbps == "measure"
    assert LowBitConfig().link == pytest.approx((50e-6, 1e9))  # unresolved: the fallbacks
    assert LowBitConfig(link_bandwidth_gbps=25, link_latency_us=10).link == pytest.approx((10e-6, 25e9))
    with pytest.raises(ConfigError, match=r"link_latency_us: got 'slow'; expected 'measure'"):
        LowBitConfig(link_latency_us="slow")
    assert LowBitConfig.from_env({"LOWBIT_LINK_BANDWIDTH_GBPS": "measure", "LOWBIT_LINK_ASSUME": "1,5"})
    assert link_probe.needs_link(LowBitConfig(algorithm="lion"))
    assert not link_probe.needs_link(LowBitConfig(algorithm="lion", mode="1bit"))
    assert not link_probe.needs_link(LowBitConfig(algorithm="turboquant", link_bandwidth_gbps=1, link_latency_us=5))
    with pytest.raises(ConfigError, match="LOWBIT_LINK_ASSUME must be 'GBPS,US'"):
        link_probe.assumed({"LOWBIT_LINK_ASSUME": "fast"})


def tiny():
    """A model for ``--measure --model`` (its compute step is timed)."""
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def tiny_batch():
    return torch.randn(8, 16)


def _agreed(value: float) -> list[float]:
    mine = torch.tensor([value], dtype=torch.float64)
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [float(t.item()) for t in out]


def _ranks(rank, world):
    from lowbit_strategy.algorithms.lion_cub.mode import resolve_mode
    from lowbit_strategy.integrations.ddp import build_sync
    from lowbit_strategy.plan import cli

    os.environ.pop(link_probe.ASSUME_ENV, None)
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    # the probe: bounded in time, the same figures on every rank
    fit = link_probe.probe()
    assert 0 < fit.seconds < 2.5 and 2 <= len(fit.points) <= 4
    assert len(set(_agreed(fit.bandwidth_gbps))) == 1 and len(set(_agreed(fit.latency_us))) == 1
    # at attach: measured once, agreed, and what BitDP's auto plans with
    sync = build_sync(LowBitConfig(algorithm="bitdp"), model)
    gbps, us = sync.config.link_bandwidth_gbps, sync.config.link_latency_us
    assert isinstance(gbps, float) and gbps > 0 and isinstance(us, float)
    assert len(set(_agreed(gbps))) == 1 and sync.state.link == sync.config.link
    # a fixed link is not probed; the figures drive Lion Cub's auto: compress when slow, bf16 when fast
    assert build_sync(LowBitConfig(algorithm="lion", link_bandwidth_gbps=2.0), model).config.link_bandwidth_gbps == 2.0
    modes = {}
    for figures in ("0.1,50", "1000,5"):
        os.environ[link_probe.ASSUME_ENV] = figures
        config = build_sync(LowBitConfig(algorithm="lion"), model).config
        modes[figures] = resolve_mode(config, world, 1 << 22, codec_seconds={"lp8": 1e-3}).mode
    assert modes == {"0.1,50": "lp", "1000,5": "bf16"}, modes  # the fallback: what DDP bf16 sends
    # lowbit-plan --measure: each rank its own node here, so the cross-node collectives are timed
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    out = io.StringIO()
    with redirect_stdout(out):
        here = __name__  # this module, importable by the ranks
        assert cli.main(["--measure", "--model", f"{here}:tiny", "--inputs", f"{here}:tiny_batch", "--json"]) == 0
    if rank == 0:
        plan = json.loads(out.getvalue())
        assert plan["measured"]["all_to_all"]["bandwidth_gbps"] > 0 and plan["measured"]["compute_s"] > 0
        assert "(measured)" in plan["assumptions"][2]
        assert len(plan["measured"]["all_gather"]["points"]) >= 2
        assert "measured on 2 ranks" in plan["assumptions"][1]
    else:
        assert out.getvalue() == ""


@pytest.mark.slow
def test_measure_at_attach_on_gloo_ranks():
    run_ranks(2, _ranks)


def _hierarchical(rank, world):
    from lowbit_strategy.integrations.ddp import build_sync

    os.environ.pop(link_probe.ASSUME_ENV, None)
    sync = build_sync(LowBitConfig(algorithm="lion", ranks_per_node=2), torch.nn.Linear(8, 8))
    assert sync.topology.hierarchical  # probed over the cross-node groups, agreed over every rank
    gbps = sync.config.link_bandwidth_gbps
    assert isinstance(gbps, float) and len(set(_agreed(gbps))) == 1


@pytest.mark.slow
def test_measure_on_a_hierarchical_topology():
    run_ranks(4, _hierarchical)
