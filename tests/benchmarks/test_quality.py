"""benchmarks/quality/driver.py's ``nodes`` suite: what it runs (every registered algorithm, flat and
hierarchical, one ``--lowbit`` per row so no override replaces another) and how its table
aggregates seeds (mean ± std, gaps paired by seed, bytes summed over a node's ranks). No
training: the runs are replaced by JSON files."""

from __future__ import annotations

import json

import pytest

from benchmarks.quality import driver as quality
from lowbit_strategy.algorithms import REGISTRY


def test_nodes_suite_pairs_every_algorithm_flat_hierarchical_and_n2():
    rows = quality.SUITES["nodes"]
    compressed = [(label, strategy, extra) for label, strategy, extra in rows if strategy != "ddp"]
    assert {label for label, strategy, _ in rows if strategy == "ddp"} == set(quality.BASELINE.values()) | {
        "DDP + AdamW"
    }
    forms: dict[tuple[str, str], set[str]] = {}
    for label, strategy, extra in compressed:
        assert extra.count("--lowbit") <= 1, label  # a second --lowbit would replace the first's overrides
        (end,) = [e for e in (", flat", ", hierarchical", *quality.ROW_LAYOUT) if label.endswith(e)]
        if end in (", flat", ", hierarchical"):
            assert extra[-1] == f"topology={end[2:]}" and quality._layout("nodes", label, 2) == (2, 2), label
        else:
            assert quality._layout("nodes", label, 2) == (1, 2) and extra[-2:] == ["--batch-size", "32"], label
        forms.setdefault((label[: -len(end)], strategy), set()).add(end)
    assert all(f == {", flat", ", hierarchical", *quality.ROW_LAYOUT} for f in forms.values()), forms
    strategies = {strategy for _, strategy in forms}
    assert all(strategies & set(algo.strategy_names) for algo in REGISTRY.values()), strategies


def _run(val: float, seed: int, per_rank: list[list[float]], topology: str) -> dict:
    return {
        "steps": 30,
        "val_loss": val + seed / 100,
        "train_loss": val,
        "fp32_bytes_per_step": 1024.0,
        "last_bytes_per_step": 512.0,
        "rank_bytes_per_step": per_rank,
        "topology": topology,
    }


def test_nodes_report_aggregates_seeds_and_nodes(tmp_path, monkeypatch):
    monkeypatch.setattr(quality, "RESULTS", tmp_path)
    monkeypatch.setitem(
        quality.SUITES,
        "nodes",
        [
            ("DDP + Lion", "ddp", []),
            ("Lion Cub 1-bit, flat", "lowbit_lion_1bit", ["--lowbit", "topology=flat"]),
            ("Lion Cub 1-bit, hierarchical", "lowbit_lion_1bit", ["--lowbit", "topology=hierarchical"]),
        ],
    )
    runs = {
        "DDP + Lion": (3.0, [[0, 0]] * 4, "–"),
        "Lion Cub 1-bit, flat": (3.1, [[2048, 0]] * 4, "flat: 2 node(s) x 2 rank(s)"),
        "Lion Cub 1-bit, hierarchical": (3.2, [[512, 4096]] * 4, "hierarchical: 2 node(s) x 2 rank(s)"),
    }
    for label, (val, per_rank, topology) in runs.items():
        for seed in (0, 1, 2):
            path = quality._file("nodes", label, "", seed)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(_run(val, seed, per_rank, topology)))
    table = quality.report("nodes", seeds=(0, 1, 2)).splitlines()
    ddp, flat, hier = (row.split(" | ") for row in table[2:])
    assert ddp[4] == "3.0100 ± 0.0100" and ddp[8] == "2.0"  # DDP: 2 ranks x its modeled 1 KiB
    assert flat[6] == "+0.1000 ± 0.0000" and flat[7] == "–" and flat[8] == "4.0" and flat[9] == "0.5× less"
    assert hier[7] == "+0.1000 ± 0.0000" and hier[8] == "1.0" and hier[9] == "2.0× less"
    assert hier[10] == "1.0" and hier[11] == "8.0 |"  # last step: 2 x rank 0's 512 bytes; intra-node
    assert hier[2] == "hierarchical: 2 node(s) x 2 rank(s)" and hier[3] == "3"
    assert (tmp_path / "quality" / "quality_nodes.md").read_text().startswith("# Quality: nodes, 2 nodes x 2 ranks, 30 steps")


@pytest.mark.parametrize("values,text", [([1.0], "1.0000"), ([float("nan"), 1.0], "diverged"), ([], "–")])
def test_mean_std_edge_cases(values, text):
    assert quality._mean_std(values) == text
