"""benchmarks/ttq/analysis.py and ttq_report.py on synthetic curves and step times: the
time-to-target arithmetic (interpolation, "not reached", mean ± std), the phase-by-phase
projection of loopback losses onto step times measured on a link, the lr choice, and the
report's tables from run records. No training here (the slow tier runs the worker)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.ttq import driver as ttq
from benchmarks.ttq import report as ttq_report
from benchmarks.ttq import analysis as ta
from benchmarks.collectives.driver import parse_link


def test_phases_split_startup_warmup_and_main():
    assert ta.phases(100, 0) == [("startup", 1, 3), ("main", 4, 100)]
    assert ta.phases(100, 20) == [("startup", 1, 3), ("warm-up", 4, 20), ("main", 21, 100)]
    # a warm-up inside the start-up (BitDP's 2 fp32 steps) is timed there, step by step
    assert ta.phases(100, 2) == [("startup", 1, 3), ("main", 4, 100)]
    # PowerSGD's default 1000-step warm-up longer than the run: no compressed phase
    assert ta.phases(500, 1000) == [("startup", 1, 3), ("warm-up", 4, 500)]


def test_phase_times_first_step_and_mean_of_the_rest():
    step_s = [5.0, 2.0, 1.5] + [1.0, 0.5, 0.5, 0.5] + [3.0, 0.2, 0.2, 0.2, 0.2]
    pt = ta.phase_times(step_s, switch=7)
    assert pt["startup"] == [5.0, 2.0, 1.5]
    assert pt["warm-up"] == {"first": 1.0, "mean": 0.5, "steps": 4}
    assert pt["main"]["first"] == 3.0 and pt["main"]["mean"] == pytest.approx(0.2) and pt["main"]["steps"] == 5


def test_projection_times_each_phase_of_the_longer_run_as_measured():
    timing = {"startup": [5.0, 2.0, 1.5], "warm-up": {"first": 1.0, "mean": 0.5, "steps": 4},
              "main": {"first": 3.0, "mean": 0.2, "steps": 5}}
    cum = ta.cumulative_seconds(steps=100, switch=20, timing=timing)
    assert len(cum) == 101 and cum[0] == 0
    assert cum[3] == pytest.approx(8.5)
    assert cum[20] == pytest.approx(8.5 + 1.0 + 16 * 0.5)  # warm-up: its first step, then its mean
    assert cum[100] == pytest.approx(cum[20] + 3.0 + 79 * 0.2)
    # the same losses at full precision all along would be timed as warm-up: slower here
    with pytest.raises(KeyError):  # a timing run without the warm-up phase cannot time one
        ta.cumulative_seconds(100, 20, {"startup": [1.0] * 3, "main": timing["main"]})


def test_steps_to_target_interpolates_and_says_not_reached():
    points = [(0, 5.0), (10, 3.0), (20, 2.0), (30, 1.5)]
    assert ta.steps_to_target(points, 2.5) == pytest.approx(15.0)
    assert ta.steps_to_target(points, 2.0) == pytest.approx(20.0)
    assert ta.steps_to_target(points, 6.0) == 0.0
    assert ta.steps_to_target(points, 1.0) is None
    # the first crossing counts, not a later dip
    assert ta.steps_to_target([(0, 4.0), (10, 2.0), (20, 3.0), (30, 1.0)], 2.5) == pytest.approx(7.5)
    assert ta.at_step(points, 25) == pytest.approx(1.75)
    assert ta.at_step(points, 31) is None


def test_seconds_and_steps_are_inverse_and_bounded_by_the_run():
    cum = [0.0, 1.0, 3.0, 6.0]
    assert ta.seconds_at(cum, 1.5) == pytest.approx(2.0)
    assert ta.step_at_seconds(cum, 2.0) == pytest.approx(1.5)
    assert ta.step_at_seconds(cum, 6.0) == pytest.approx(3.0)
    assert ta.step_at_seconds(cum, 6.5) is None


def test_mean_std_and_not_reached():
    assert ta.summary([10.0, 12.0, 14.0]) == "12.0 ± 2.0"
    assert ta.summary([10.0]) == "10.0"
    assert ta.summary([None, None]) == "not reached"
    assert ta.summary([10.0, None, 12.0]) == "not reached in 1 of 3 seeds"
    m, s = ta.mean_std([1.0, 2.0, 3.0])
    assert (m, s) == (2.0, 1.0)


def test_best_lr_lowest_loss_then_nearest_default_then_smaller():
    assert ta.best_lr({1e-3: 2.0, 2e-3: 1.9, 5e-4: 2.1}, 1e-3) == 2e-3
    assert ta.best_lr({1e-3: 2.0, 2e-3: 2.0, 5e-4: 2.0}, 1e-3) == 1e-3
    assert ta.best_lr({2e-3: 2.0, 5e-4: 2.0}, 1e-3) == 5e-4
    assert ta.best_lr({1e-3: math.nan, 2e-3: 3.0}, 1e-3) == 2e-3


def test_the_sweep_goes_on_past_an_edge_optimum():
    # DDP + AdamW's first sweep here: the lowest lr was best, so half of it is tried next
    assert ttq.beyond_edge({1.5e-3: 1.52, 3e-3: 1.78, 6e-3: 2.13}, 3e-3) == 7.5e-4
    assert ttq.beyond_edge({5e-4: 2.0, 1e-3: 1.9, 2e-3: 1.8}, 1e-3) == 4e-3  # the highest: twice it
    assert ttq.beyond_edge({5e-4: 2.0, 1e-3: 1.7, 2e-3: 1.8}, 1e-3) is None  # inside: done
    assert ttq.beyond_edge({1e-3: 1.7}, 1e-3) is None
    assert ttq.beyond_edge({5e-4: 1.9, 1e-3: 1.8, 2e-3: math.nan}, 1e-3) is None  # the highest diverged: inside


def test_sweeps_are_centred_where_their_reference_sweep_ended():
    # the references sweep around the example's default; the others around the default times the
    # factor their reference moved by (DDP + AdamW for the AdamW family, DDP + Lion for Lion)
    chosen = {"ddp_adamw@1gbit": 7.5e-4, "ddp_lion@1gbit": 2.5e-4}
    assert ttq.centre_lr("ddp_adamw", chosen) == 3e-3
    assert ttq.centre_lr("ddp_lion", chosen) == 1e-3
    assert ttq.centre_lr("lowbit_adam", chosen) == 7.5e-4
    assert ttq.centre_lr("lowbit_turboquant", chosen) == 7.5e-4
    assert ttq.centre_lr("ddp_bf16_lion", chosen) == 2.5e-4
    assert ttq.centre_lr("lowbit_lion_1bit", {"ddp_adamw@1gbit": 7.5e-4}) == 1e-3  # Lion's reference not swept yet
    assert ttq.lrs_of(7.5e-4, [0.5, 1, 2]) == [3.75e-4, 7.5e-4, 1.5e-3]

def test_target_is_the_reference_at_80_percent_mean_over_seeds():
    curves = [[(0, 5.0), (80, 2.0), (100, 1.9)], [(0, 5.0), (80, 2.2), (100, 2.0)]]
    assert ta.target_loss(curves, 100) == pytest.approx(2.1)
    with pytest.raises(ValueError):
        ta.target_loss([[(0, 5.0), (50, 3.0)]], 100)


def test_switch_follows_torch_default_for_powersgd_and_20_percent_for_onebit():
    assert ttq.switch_of("ddp_powersgd_adamw", 1500, None) == 1000  # torch's start_powerSGD_iter
    assert ttq.switch_of("ddp_powersgd_lion", 120, "20%") == 24
    assert ttq.switch_of("lowbit_adam", 1500, None) == 300
    assert ttq.switch_of("lowbit_turboquant", 100, None) == 20
    assert ttq.switch_of("ddp_bf16_adamw", 1500, None) == 0
    assert ttq.switch_of("lowbit_lion_1bit", 1500, None) == 0


def _timing(config, step, switch, wire):
    steps = 3 + (8 if switch else 0) + 10
    step_s = [1.0, 1.0, 1.0] + ([0.5] * 8 if switch else []) + [step] * 10
    marks = {"3": [[0, 0, 0, 0]] * 2, str(steps): [[0, 0, wire * steps, wire * steps]] * 2}
    return {"config": config, "step_s": step_s, "switch": switch, "plan": [], "topology": "flat (DDP)",
            "counters": marks, "params": 1000, "link": "1gbit"}


def _quality(config, lr, seed, slope):
    evals = [(s, 0.0, 5.0 - slope * s / 100) for s in range(0, 101, 10)]
    return {"config": config, "lr": lr, "seed": seed, "evals": evals, "plan": [], "link": "loopback"}


def test_report_projects_loopback_losses_onto_link_step_times(tmp_path):
    """ddp_adamw (0.2 s/step) learns slower per step than ddp_bf16_adamw (0.1 s/step): target at step
    80 of ddp_adamw's curve; bf16 reaches it sooner in steps and seconds; 'lowbit_adam' never does."""
    configs = ["ddp_adamw", "ddp_bf16_adamw", "lowbit_adam"]
    settings = {"configs": configs, "links": ["1gbit"], "steps": 100, "switch": {"ddp_adamw": 0,
                "ddp_bf16_adamw": 0, "lowbit_adam": 20}, "seeds": [0, 1], "lr_factors": [1.0], "swept": [],
                "model": {"d_model": 8, "layers": 1, "heads": 1, "seq": 8, "batch": 1}, "eval_every": 10,
                "val_batches": 1, "lr_warmup": 1, "powersgd": {}, "default_lr": {}}
    slopes = {"ddp_adamw": 2.0, "ddp_bf16_adamw": 2.5, "lowbit_adam": 0.5}
    runs = {"timing": {("ddp_adamw", "1gbit"): _timing("ddp_adamw", 0.2, 0, 1000),
                       ("ddp_bf16_adamw", "1gbit"): _timing("ddp_bf16_adamw", 0.1, 0, 500),
                       ("lowbit_adam", "1gbit"): _timing("lowbit_adam", 0.05, 11, 50)},
            "keys": {(c, "1gbit"): c for c in configs}, "chosen": {c: 1e-3 for c in configs},
            "sweep": {c: {1e-3: 5.0 - slopes[c]} for c in configs},
            "quality": {c: {(1e-3, s): _quality(c, 1e-3, s, slopes[c] + 0.1 * s) for s in (0, 1)}
                        for c in configs}, "full": []}
    result = ttq_report.write(tmp_path, settings, "test", {"cpu": "x", "cores": 2, "torch": "t"}, runs)
    link = result["links"]["1gbit"]
    assert link["target"] == pytest.approx(5.0 - (2.0 + 2.1) / 2 * 0.8)
    bf16 = link["rows"]["ddp_bf16_adamw"]["per_seed"][0]
    s_t = (5.0 - link["target"]) / 2.5 * 100
    assert bf16["steps_to_target"] == pytest.approx(s_t)
    assert bf16["seconds_to_target"] == pytest.approx(3.0 + (s_t - 3) * 0.1)
    # 13 steps' bytes counted over the 10 steps after the start-up mark
    assert link["rows"]["ddp_bf16_adamw"]["wire_bytes_per_step"]["main"] == pytest.approx(500 * 13 / 10)
    assert link["rows"]["lowbit_adam"]["per_seed"][0]["steps_to_target"] is None
    # budget: the fastest whole run: ddp_bf16_adamw's (lowbit_adam's takes 3 + 17 x 0.5 + 80 x 0.05 = 15.5 s)
    assert link["budget_s"] == pytest.approx(3 + 97 * 0.1)
    assert link["rows"]["lowbit_adam"]["projected_seconds"] == pytest.approx(15.5)
    at = (link["budget_s"] - 3 - 17 * 0.5) / 0.05 + 20  # the step lowbit_adam reaches in that budget
    assert link["rows"]["lowbit_adam"]["per_seed"][0]["loss_at_budget"] == pytest.approx(5.0 - 0.5 * at / 100)
    md = (tmp_path / "ttq.md").read_text()
    assert "not reached" in md and "DDP bf16 + AdamW" in md and (tmp_path / "ttq_loss.png").exists()
    assert "fastest to the target: DDP bf16 + AdamW" in md
    assert "? s in all" in md  # the header: how long the study took (unknown here)
    assert "Timed under other load" not in md
    runs["timing"][("lowbit_adam", "1gbit")]["other_load"] = 0.12
    ttq_report.write(tmp_path, settings, "test", {"cpu": "x", "cores": 2, "torch": "t"}, runs)
    assert "**Timed under other load** (over 5% of the cores busy with other work): lowbit_adam@1gbit (12%)" in \
        (tmp_path / "ttq.md").read_text()
    ttq_report.write(tmp_path, {**settings, "report_only": True}, "test --report-only", {"cpu": "x", "cores": 2,
                                                                                       "torch": "t"}, runs)
    header = (tmp_path / "ttq.md").read_text().splitlines()[2]
    assert header.startswith("`test --report-only`") and "a report of the recorded runs" in header, header


def test_a_fixed_lr_is_parsed_run_and_said():
    """``--lr lowbit_lamb=0.006``: that configuration's only lr (no sweep, no extension); a bad pair
    names itself."""
    assert ttq.parse_lrs("lowbit_lamb=0.006, lowbit_adam=7.5e-4") == {"lowbit_lamb": 0.006, "lowbit_adam": 7.5e-4}
    assert ttq.parse_lrs("") == {}
    for bad in ("nope=0.1", "lowbit_lamb=x", "lowbit_lamb=0", "lowbit_lamb"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad.strip())):
            ttq.parse_lrs(bad)
    settings, runs = _one_link_study(["ddp_adamw", "lowbit_adam"], {"ddp_adamw": 2.0, "lowbit_adam": 2.0},
                                     {"ddp_adamw": 0.2, "lowbit_adam": 0.1})
    settings["fixed_lr"] = {"lowbit_adam": 1e-3}
    machine = {"cpu": "x", "cores": 2, "torch": "t"}
    md = ttq_report.markdown(ttq_report.analyse(settings, runs), settings, "test", machine)
    assert "learning rates fixed, not swept in these runs (an earlier sweep's choice, `--lr`): lowbit_adam 0.001" in md
    assert "| lowbit_adam | – | 0.001: 3.0000 | 0.001 (fixed: --lr) |" in md


def test_a_fixed_lr_is_the_only_lr_its_configuration_runs(tmp_path):
    """``execute`` with ``--lr lowbit_lamb=0.006``: lowbit_lamb runs 0.006 for every seed, nothing
    swept or extended; a swept configuration beside it still runs its sweep."""
    args = SimpleNamespace(links="1gbit", model=[("d_model", 32)], max_minutes=1, val_batches=2, lr_warmup=0,
                           steps=100, timing_warm=5, timing_main=5, powersgd_start=None, eval_every=10,
                           warmup_wire="bf16", sweep_extend=2, lr={"lowbit_lamb": 0.006}, no_bound=True)
    study = ttq.Study(args, tmp_path)
    study.load_only = True
    asked = []

    def run(kind, name, settings, link=None, net=None):
        asked.append(name)
        final = 3.0 - settings["lr"] if kind == "quality" else 0.0  # the highest lr best: an edge every time
        return {"config": settings["config"], "plan": [], "evals": [(1, 0.0, final)], "lr": settings["lr"]}

    study.run = run
    runs = ttq.execute(study, ["ddp_adamw", "lowbit_lamb"], [0, 1], [0.5, 1.0, 2.0], ["ddp_adamw", "lowbit_lamb"], [])
    lamb = [n for n in asked if n.startswith("lowbit_lamb_")]
    assert lamb == ["lowbit_lamb_lr0.006_seed0", "lowbit_lamb_lr0.006_seed1"], lamb
    assert runs["chosen"]["lowbit_lamb"] == 0.006
    adamw = [n for n in asked if n.startswith("ddp_adamw_") and n.endswith("seed0")]
    assert len(adamw) == 3 + 2  # the sweep and its two extensions


def test_a_full_run_is_compared_only_with_a_projection_its_own_code_timed(tmp_path):
    """A full run on the link checks the projection of its timing run; after a retime by other code
    (or on another machine) the error columns say so instead of a number."""
    configs = ["ddp_adamw", "ddp_bf16_adamw"]
    settings, runs = _one_link_study(configs, {"ddp_adamw": 2.0, "ddp_bf16_adamw": 2.0},
                                     {"ddp_adamw": 0.2, "ddp_bf16_adamw": 0.1})
    full = {**_quality("ddp_bf16_adamw", 1e-3, 0, 2.0), "link": "1gbit", "step_s": [0.11] * 100}
    for code, same in (("abc", True), ("old", False)):
        runs["timing"][("ddp_bf16_adamw", "1gbit")]["code"] = "abc"
        runs["full"] = [{**full, "code": code}]
        result = ttq_report.write(tmp_path, settings, "test", {"cpu": "x", "cores": 2, "torch": "t"}, runs)
        v = result["validation"][0]
        line = next(ln for ln in (tmp_path / "ttq.md").read_text().splitlines() if ln.startswith("| ddp_bf16_adamw"))
        if same:
            assert v["error_seconds"] == pytest.approx((v["projected_seconds"] - 11.0) / 11.0)
            assert "timed by other code" not in line
        else:
            assert v["error_seconds"] is None and v["error_seconds_to_target"] is None
            assert line.count("timed by other code") == 2, line


def _one_link_study(configs, slopes, step_s, bound=None):
    """(settings, runs) of a 100-step study on 1 Gbit/s, 2 seeds, every configuration without a
    warm-up: straight loss lines of the given slopes, steady step times; ``bound``: the comm-free
    runs' step times by configuration."""
    settings = {"configs": configs, "links": ["1gbit"], "steps": 100, "switch": dict.fromkeys(configs, 0),
                "seeds": [0, 1], "lr_factors": [1.0], "swept": [],
                "model": {"d_model": 8, "layers": 1, "heads": 1, "seq": 8, "batch": 1}, "eval_every": 10,
                "val_batches": 1, "lr_warmup": 1, "powersgd": {}, "default_lr": {}}
    runs = {"timing": {(c, "1gbit"): _timing(c, step_s[c], 0, 100) for c in configs},
            "bound": {(c, "1gbit"): _timing(c, t, 0, 0) for c, t in (bound or {}).items()},
            "keys": {(c, "1gbit"): c for c in configs}, "chosen": dict.fromkeys(configs, 1e-3),
            "sweep": {c: {1e-3: 5.0 - slopes[c]} for c in configs},
            "quality": {c: {(1e-3, s): _quality(c, 1e-3, s, slopes[c] + 0.1 * s) for s in (0, 1)}
                        for c in configs}, "full": []}
    return settings, runs


def test_lion_family_gets_its_own_target_and_its_bf16_ratio(tmp_path):
    """Lion never reaches AdamW's target here (as at this model's batch size): the Lion family is
    also timed to DDP fp32 + Lion's own 80 % loss, and compared with DDP bf16 + Lion there."""
    configs = ["ddp_adamw", "ddp_lion", "ddp_bf16_lion", "lowbit_lion"]
    slopes = {"ddp_adamw": 2.0, "ddp_lion": 1.0, "ddp_bf16_lion": 1.0, "lowbit_lion": 1.0}
    step_s = {"ddp_adamw": 0.2, "ddp_lion": 0.2, "ddp_bf16_lion": 0.1, "lowbit_lion": 0.05}
    settings, runs = _one_link_study(configs, slopes, step_s)
    result = ttq_report.write(tmp_path, settings, "test", {"cpu": "x", "cores": 2, "torch": "t"}, runs)
    link = result["links"]["1gbit"]
    own = link["own_targets"]["lion"]
    assert own == pytest.approx(5.0 - (1.0 + 1.1) / 2 * 0.8)
    lion = link["rows"]["lowbit_lion"]["per_seed"][0]
    assert lion["steps_to_target"] is None  # AdamW's target: out of reach
    s_t = (5.0 - own) / 1.0 * 100
    assert lion["own_steps_to_target"] == pytest.approx(s_t)
    assert lion["own_seconds_to_target"] == pytest.approx(3.0 + (s_t - 3) * 0.05)
    assert "own_steps_to_target" not in link["rows"]["ddp_adamw"]["per_seed"][0]  # AdamW: one target
    md = (tmp_path / "ttq.md").read_text()
    bf16_s = [link["rows"]["ddp_bf16_lion"]["per_seed"][k]["own_seconds_to_target"] for k in (0, 1)]
    ours = [link["rows"]["lowbit_lion"]["per_seed"][k]["own_seconds_to_target"] for k in (0, 1)]
    ratio = sum(bf16_s) / sum(ours)
    assert ratio > 1.5 and "| Lion Cub (auto) | " in md and f"{ratio:.2f}×" in md
    assert "Lion family to its own target" in md and "fastest Lion Cub (auto)" in md
    fp32_s = [link["rows"]["ddp_lion"]["per_seed"][k]["own_seconds_to_target"] for k in (0, 1)]
    row = next(line for line in md.splitlines() if line.startswith("| Lion Cub (auto) | ") and line.count("×") == 2)
    # × DDP bf16 + Lion, of the bound (no comm-free run here), × DDP fp32 + Lion
    assert row.endswith(f"| {ratio:.2f}× | – | {sum(fp32_s) / sum(ours):.2f}× |")
    assert f"DDP bf16 + Lion {sum(bf16_s) / 2:.1f} s: {ratio:.2f}× slower" in md


def test_the_comm_free_bound_prices_the_references_steps_at_the_comm_free_step(tmp_path):
    """The bound to each target: DDP fp32's steps to it (per seed) at the comm-free run's step time;
    every method's time as a fraction of it, in the table and the facts."""
    configs = ["ddp_adamw", "ddp_bf16_adamw", "ddp_lion", "lowbit_lion"]
    slopes = {"ddp_adamw": 2.0, "ddp_bf16_adamw": 2.0, "ddp_lion": 1.0, "lowbit_lion": 1.0}
    step_s = {"ddp_adamw": 0.2, "ddp_bf16_adamw": 0.1, "ddp_lion": 0.2, "lowbit_lion": 0.08}
    settings, runs = _one_link_study(configs, slopes, step_s, bound={"calib_adamw": 0.04, "calib_lion": 0.05})
    result = ttq_report.write(tmp_path, settings, "test", {"cpu": "x", "cores": 2, "torch": "t"}, runs)
    link = result["links"]["1gbit"]
    bound, lion_bound = link["bounds"][""], link["bounds"]["lion"]
    ref = link["rows"]["ddp_adamw"]["per_seed"]
    for seed in (0, 1):  # the reference's steps, the comm-free step time (3 start-up steps of 1 s)
        s_t = ref[seed]["steps_to_target"]
        assert bound["per_seed"][seed]["steps_to_target"] == s_t
        assert bound["per_seed"][seed]["seconds_to_target"] == pytest.approx(3.0 + (s_t - 3) * 0.04)
    mean = lambda rows, c, f: sum(rows[c]["per_seed"][k][f] for k in (0, 1)) / 2  # noqa: E731
    bf16 = ttq_report.of_bound(link["rows"], "ddp_bf16_adamw", bound)
    expect = sum(bound["per_seed"][k]["seconds_to_target"] for k in (0, 1)) / 2 / mean(
        link["rows"], "ddp_bf16_adamw", "seconds_to_target")
    assert bf16 == pytest.approx(expect) and 0 < bf16 < 1
    lion = ttq_report.of_bound(link["rows"], "lowbit_lion", lion_bound)
    assert lion == pytest.approx(sum(lion_bound["per_seed"][k]["own_seconds_to_target"] for k in (0, 1)) / 2
                                 / mean(link["rows"], "lowbit_lion", "own_seconds_to_target"))
    assert ttq_report.of_bound(link["rows"], "lowbit_lion", bound) is None  # AdamW's target: out of reach
    md = (tmp_path / "ttq.md").read_text()
    assert md.count("| **comm-free bound**") == 2 and f"| {bf16:.2f} |" in md and f"| {lion:.2f} |" in md
    assert "of the comm-free bound" in md


def test_quality_runs_are_shared_across_links_only_for_one_recorded_plan():
    links = [parse_link("1gbit"), parse_link("100mbit")]
    study = SimpleNamespace(links=links)
    lp = ["Plan(mode='lp', bits=8, levels=31)"]
    timing = {("lowbit_lion", "1gbit"): {"plan": lp}, ("lowbit_lion", "100mbit"): {"plan": lp},
              ("lowbit_turboquant", "1gbit"): {"plan": ["forms: fp32 x2, tq x5"]},
              ("lowbit_turboquant", "100mbit"): {"plan": ["forms: tq x7"]}}
    keys = ttq.quality_keys(study, ["lowbit_lion", "lowbit_turboquant", "ddp_adamw"], timing)
    assert keys[("lowbit_lion", "1gbit")] == keys[("lowbit_lion", "100mbit")] == ("lowbit_lion@1gbit", links[0])
    assert keys[("lowbit_turboquant", "100mbit")] == ("lowbit_turboquant@100mbit", links[1])
    assert keys[("ddp_adamw", "100mbit")] == ("ddp_adamw", links[0])  # no plan: one quality key
    # an unrecorded plan on both links is not "the same plan": each link gets its own runs
    blind = {k: {"plan": []} for k in timing}
    keys = ttq.quality_keys(study, ["lowbit_lion"], blind)
    assert keys[("lowbit_lion", "100mbit")] == ("lowbit_lion@100mbit", links[1])
    assert ttq.unplanned("timing", {"config": "lowbit_lion", "plan": []})
    assert not ttq.unplanned("timing", {"config": "lowbit_lion", "plan": lp})
    assert not ttq.unplanned("timing", {"config": "ddp_adamw", "plan": []})
    assert not ttq.unplanned("quality", {"config": "lowbit_lion", "plan": []})


def test_resolved_plans_reads_lion_cubs_plan_and_turboquants_forms():
    from benchmarks.e2e.worker import resolved_plans
    from lowbit_strategy.algorithms.lion_cub import SyncMode

    lion = SimpleNamespace(communicator=SimpleNamespace(plan=SyncMode("lp", 8, 31)))
    turbo = SimpleNamespace(_optimizer=SimpleNamespace(communicator=SimpleNamespace(
        plan=None, forms={"b2": "tq", "b0": "fp32", "b1": "tq"})))
    assert resolved_plans([lion, turbo, SimpleNamespace()]) == [
        "Plan(mode='lp', bits=8, levels=31)", "forms: fp32 x1, tq x2"]
    unresolved = SimpleNamespace(communicator=SimpleNamespace(plan=None, forms={}))
    assert resolved_plans([unresolved]) == []


def test_code_fingerprint_follows_the_code_runs_execute(tmp_path, monkeypatch):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "worker.py").write_text("y = 2\n")
    monkeypatch.setattr(ttq, "ROOT", tmp_path)
    monkeypatch.setattr(ttq, "CODE", ["pkg", "worker.py"])
    first = ttq.code_fingerprint()
    assert first == ttq.code_fingerprint() and len(first) == 12
    (tmp_path / "pkg" / "a.py").write_text("x = 3\n")  # a codec made faster, say
    second = ttq.code_fingerprint()
    assert second != first
    (tmp_path / "pkg" / "notes.txt").write_text("not code")
    assert ttq.code_fingerprint() == second
    monkeypatch.setattr(ttq, "NOT_RUN", ["pkg/planner"])
    (tmp_path / "pkg" / "planner").mkdir()
    (tmp_path / "pkg" / "planner" / "cli.py").write_text("z = 1\n")
    assert ttq.code_fingerprint() == second  # code no run executes
    timing = {"config": "ddp_adamw", "plan": [], "code": first}
    assert ttq.reusable("timing", timing, second, retime=False)
    assert not ttq.reusable("timing", timing, second, retime=True)
    assert ttq.reusable("timing", {**timing, "code": second}, second, retime=True)
    assert ttq.reusable("quality", timing, second, retime=True)  # --retime times again; losses are kept
    assert not ttq.reusable("timing", {**timing, "config": "lowbit_lion"}, first, retime=False)


def test_plan_check_tells_differs_from_unrecorded():
    lp = ["Plan(mode='lp', bits=8, levels=63)"]
    assert ttq_report.plan_check("lowbit_lion", lp, [lp, lp]) == "same"
    assert ttq_report.plan_check("lowbit_lion", lp, [lp, ["Plan(mode='fp32', bits=32, levels=0)"]]) == "DIFFERS"
    assert ttq_report.plan_check("lowbit_lion", lp, [[], lp, []]) == "unrecorded in 2 of 3"
    assert ttq_report.plan_check("ddp_adamw", [], [[], []]) == "same"
    # a fixed mode's plan is the configuration's: an old run without it is not a mismatch
    assert ttq_report.plan_check("lowbit_lion_1bit", ["Plan(mode='1bit', bits=1, levels=0)"], [[]]) == "same"
    # nor is a new quality run beside a timing run made before plans were recorded
    assert ttq_report.plan_check("lowbit_lion_1bit", [], [["Plan(mode='1bit', bits=1, levels=0)"]]) == "same"


def test_ratios_pair_seeds_and_rows_say_when_seeds_are_missing():
    settings = {"seeds": [0, 1, 2]}
    rows = {"a": {"per_seed": {0: {"t": 10.0}, 1: {"t": 20.0}}},
            "ref": {"per_seed": {0: {"t": 20.0}, 1: {"t": 40.0}, 2: {"t": 1000.0}}}}
    assert ttq_report._ratio(rows, "a", "ref", "t") == pytest.approx(2.0)  # seed 2 of ref left out
    assert ttq_report._seed_note(rows["a"], settings) == " (2 of 3 seeds)"
    assert ttq_report._seed_note(rows["ref"], settings) == ""
    rows["a"]["per_seed"][1]["t"] = None
    assert ttq_report._ratio(rows, "a", "ref", "t") is None


def test_a_target_met_at_the_first_evaluation_gives_no_ratio_and_no_division_by_zero():
    """A short or flat curve (the smoke runs: 24 steps) can start at or below the smoothed target;
    CI once failed on the ZeroDivisionError this made."""
    rows = {"a": {"per_seed": {0: {"t": 0.0}}}, "ref": {"per_seed": {0: {"t": 3.0}}}}
    assert ttq_report._ratio(rows, "a", "ref", "t") is None
    assert ttq_report._ratio(rows, "ref", "a", "t") == 0.0
    assert ttq_report._times_slower(3.0, 0.0) == "the fastest met it at the first evaluation"
    assert ttq_report._times_slower(0.0, 0.0) == "both met at the first evaluation"
    assert ttq_report._times_slower(3.0, 2.0) == "1.50× slower"
    assert ttq_report._times_slower(2.0, 2.0) == "1.00× as fast"


def test_a_warm_up_inside_the_start_up_steps_is_refused(capsys):
    with pytest.raises(SystemExit):
        ttq.main(["--configs", "ddp_powersgd_adamw", "--powersgd-start", "2", "--dry-run"])
    assert "--powersgd-start above 3" in capsys.readouterr().err


def test_smoothing_keeps_a_trend_and_a_crossing_off_one_noisy_evaluation():
    line = [(float(s), 5.0 - s / 100) for s in range(0, 101, 10)]
    smoothed = ta.smooth(line)
    assert [s for s, _ in smoothed] == [s for s, _ in line]
    assert [v for _, v in smoothed[1:-1]] == pytest.approx([v for _, v in line[1:-1]])  # a line keeps its inside
    assert smoothed[0][1] == pytest.approx(4.95)  # the ends average what they have
    assert ta.smooth(line, half=0) == line
    # one evaluation 0.05 below the trend at step 50: the trend crosses 4.46 at step 54, the raw
    # curve already at 49.3 (on the dip), the smoothed one at 52.3
    dipped = [(s, v - (0.05 if s == 50 else 0.0)) for s, v in line]
    assert ta.steps_to_target(line, 4.46) == pytest.approx(54.0)
    assert ta.steps_to_target(dipped, 4.46) == pytest.approx(49.33, abs=0.01)
    assert ta.steps_to_target(ta.smooth(dipped), 4.46) == pytest.approx(52.33, abs=0.01)


def test_a_link_planned_plan_is_pinned_after_its_first_timing_run(tmp_path):
    """``auto`` resolves a plan from a codec time measured at start-up, so near a tie it can
    differ from run to run (TurboQuant at 1 Gbit/s: fp32 in the timing run, all-gather in 2 of 3
    quality runs). The first timing run's plan is pinned in every later run of that link."""
    assert ttq.pin("lowbit_lion", ["Plan(mode='lp', bits=8, levels=63)"]) == "lion_mode=lp,lion_bits=8"
    assert ttq.pin("lowbit_lion", ["Plan(mode='1bit', bits=1, levels=0)"]) == "lion_mode=1bit"
    assert ttq.pin("lowbit_turboquant", ["forms: fp32 x1"]) == "turboquant_form=fp32"
    assert ttq.pin("lowbit_turboquant", ["forms: allgather x2, fp32 x1"]) == ""  # one field, two forms
    assert ttq.pin("lowbit_turboquant", []) == ""
    with pytest.raises(ValueError, match="cannot read"):
        ttq.pin("lowbit_lion", ["Plan(mode=lp)"])
    args = SimpleNamespace(links="1gbit,100mbit", model=[("d_model", 32)], max_minutes=1, val_batches=2,
                           lr_warmup=0, steps=100, timing_warm=5, timing_main=5, powersgd_start=None, eval_every=10,
                           warmup_wire="bf16")
    study = ttq.Study(args, tmp_path)
    gbit = study.links[0]
    told = "warmup_wire=bf16,link_bandwidth_gbps=1,link_latency_us=50"
    assert study.timing_settings("lowbit_turboquant", gbit)["lowbit"] == told  # no run yet: auto resolves it
    study.path("timing", "lowbit_turboquant@1gbit").parent.mkdir(parents=True)
    study.path("timing", "lowbit_turboquant@1gbit").write_text(json.dumps({"plan": ["forms: fp32 x1"]}))
    pinned = told + ",turboquant_form=fp32"
    assert study.timing_settings("lowbit_turboquant", gbit)["lowbit"] == pinned
    assert study.quality_settings("lowbit_turboquant", gbit, 1e-3, 1)["lowbit"] == pinned
    assert study.quality_settings("lowbit_turboquant", study.links[1], 1e-3, 1)["lowbit"] == \
        "warmup_wire=bf16,link_bandwidth_gbps=0.1,link_latency_us=50"
    assert study.timing_settings("ddp_adamw", gbit)["lowbit"] == ""


def test_runs_recorded_before_warmup_wire_are_its_fp32_runs(tmp_path):
    """A run with an uncompressed phase recorded before ``warmup_wire`` (2026-11-29) ran it in fp32:
    ``--warmup-wire fp32`` keeps it, the default (bf16) makes the run again; other runs are unaffected."""
    base = dict(links="1gbit", model=[("d_model", 32)], max_minutes=1, val_batches=2, lr_warmup=0, steps=100,
                timing_warm=5, timing_main=5, powersgd_start=None, eval_every=10)
    gbit = parse_link("1gbit")
    old = {"lowbit_adam": "", "ddp_adamw": ""}
    for wire in ("fp32", "bf16"):
        study = ttq.Study(SimpleNamespace(**base, warmup_wire=wire), tmp_path)
        for config, lowbit in old.items():
            path = study.path("quality", f"{config}_{wire}")
            path.parent.mkdir(parents=True, exist_ok=True)
            wanted = study.quality_settings(config, gbit, 1e-3, 0)
            path.write_text(json.dumps({"settings": {**wanted, "lowbit": lowbit}}))
            kept = study.load(path, wanted) is not None
            assert kept == (config == "ddp_adamw" or wire == "fp32"), (config, wire)
    assert study.quality_settings("lowbit_adam", gbit, 1e-3, 0)["lowbit"] == "warmup_wire=bf16"


def test_warmup_wire_per_configuration():
    """``--warmup-wire fp32,lowbit_adam=bf16``: the exception's runs ask for bf16, every other wired
    configuration for the default; a bad item names itself and the choices; the report says it."""
    base = dict(links="1gbit", model=[("d_model", 32)], max_minutes=1, val_batches=2, lr_warmup=0, steps=100,
                timing_warm=5, timing_main=5, powersgd_start=None, eval_every=10)
    gbit = parse_link("1gbit")
    wire = ttq.parse_wire("fp32, lowbit_adam=bf16")
    study = ttq.Study(SimpleNamespace(**base, warmup_wire=wire), Path("/nonexistent"))
    assert study.quality_settings("lowbit_adam", gbit, 1e-3, 0)["lowbit"] == "warmup_wire=bf16"
    assert study.quality_settings("lowbit_lamb", gbit, 1e-3, 0)["lowbit"] == "warmup_wire=fp32"
    assert study.timing_settings("ddp_adamw", gbit)["lowbit"] == ""
    assert ttq.wire_of("bf16", "lowbit_lamb") == "bf16"
    coded = ttq.parse_wire("bf16,lowbit_adam=int2")  # the staged optimizers' warm-ups in BitDP's codes
    assert ttq.wire_of(coded, "lowbit_adam") == "int2" and ttq.wire_of(coded, "lowbit_lion") == "bf16"
    for bad, named in (("int8", "'int8'"), ("fp32,ddp_adamw=bf16", "'ddp_adamw=bf16'"),
                       ("fp32,lowbit_adam=fp16", "'lowbit_adam=fp16'"), ("int2", "'int2'"),
                       ("bf16,lowbit_lion=int2", "'lowbit_lion=int2'")):
        with pytest.raises(argparse.ArgumentTypeError, match=named):
            ttq.parse_wire(bad)
    assert ttq_report.wires_said(wire) == "`warmup_wire=fp32`, except lowbit_adam: `bf16`"
    assert ttq_report.wires_said("bf16") == "`warmup_wire=bf16`"


def test_the_timing_run_that_chose_a_plan_is_kept_when_its_plan_is_pinned():
    """The first timing run lets auto choose; the settings asked for afterwards pin that plan.
    The run is the plan of record itself, so a resume must not make it again."""
    auto = {"config": "lowbit_turboquant", "steps": 48, "lowbit": "link_bandwidth_gbps=1,link_latency_us=50"}
    rec = {"settings": auto, "plan": ["forms: fp32 x1"]}
    pinned = {**auto, "lowbit": auto["lowbit"] + ",turboquant_form=fp32"}
    assert ttq.Study.chose_its_pin(rec, pinned)
    assert not ttq.Study.chose_its_pin(rec, {**auto, "lowbit": auto["lowbit"] + ",turboquant_form=allgather"})
    assert not ttq.Study.chose_its_pin(rec, {**pinned, "steps": 49})  # other settings still count
    assert not ttq.Study.chose_its_pin(rec, auto)  # (equal settings are matched as such)
    assert not ttq.Study.chose_its_pin({"settings": auto, "plan": ["forms: fp32 x1, tq x2"]}, pinned)


def test_what_the_fingerprint_leaves_out_is_never_imported_by_a_run():
    """ttq.NOT_RUN holds because training never imports it: the package, the callbacks and the
    workers a run executes load none of its modules (a fresh interpreter: tests import them)."""
    import subprocess
    import sys

    names = [n.replace("/", ".") for n in ttq.NOT_RUN]
    code = (
        "import sys, lowbit_strategy, callbacks, benchmarks.ttq.worker, benchmarks.e2e.worker\n"
        f"hit = [m for m in sys.modules if m.startswith(tuple({names!r}))]\n"
        "assert not hit, hit\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ttq.ROOT, check=True, timeout=120)


def test_diloco_forms_carry_their_config_and_time_two_rounds(tmp_path):
    """A DiLoCo form's runs carry its LowBitConfig overrides, and its timing run's main phase
    spans two rounds, so that the phase's mean step carries the sync amortized over H."""
    from benchmarks.e2e.worker import CONFIGS

    args = SimpleNamespace(links="10mbit", model=[("d_model", 32)], max_minutes=1, val_batches=2, lr_warmup=0,
                           steps=100, timing_warm=5, timing_main=5, powersgd_start=None, eval_every=10)
    study = ttq.Study(args, tmp_path)
    link = study.links[0]
    for config, overrides in ttq.DILOCO.items():
        assert CONFIGS[config] == ("lowbit_diloco", "adamw") and config in ttq.ALGORITHMS
        timing = study.timing_settings(config, link)
        h = ttq.diloco_h(config)
        assert h in (10, 50, 150) and f"diloco_sync_every={h}" in overrides
        assert timing["lowbit"] == overrides == study.quality_settings(config, link, 1e-3, 0)["lowbit"]
        assert timing["steps"] == ta.STARTUP + max(5, 2 * h) and timing["switch"] == 0  # both syncs inside the main phase
    assert ttq.diloco_h("ddp_adamw") == 0 and study.timing_settings("ddp_adamw", link)["steps"] == ta.STARTUP + 5


def test_a_report_of_recorded_runs_says_so_when_made_again(tmp_path):
    """``--report-only`` over a selection no study ran says it is a report of recorded runs, and
    says so again when the same selection is reported again (it then keeps the first's date)."""
    argv = ["--configs", "ddp_adamw", "--links", "1gbit", "--validate", "", "--report-only", "--output", str(tmp_path)]
    headers = []
    for _ in range(2):
        assert ttq.main(argv) == 0
        headers.append((tmp_path / "ttq.md").read_text().splitlines()[2])
    assert all("a report of the recorded runs" in h for h in headers), headers
    assert headers[0] == headers[1]
