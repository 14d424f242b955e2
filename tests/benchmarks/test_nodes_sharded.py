"""The sharded benchmark's report and projection, without running anything (the runs need root
and namespaces; their bytes are checked in tests/integrations/test_sharded_bytes.py)."""
import pytest

from benchmarks.nodes import sharded as nodes_sharded
from benchmarks.nodes import sharded_projection as nodes_sharded_projection
from benchmarks.nodes import sharded_cost


def _rec(config, link, step_s, link_bytes, state=1000, errors=0):
    return {"config": config, "link": link, "step_s": step_s, "cross_node_bytes_per_node_per_step": [link_bytes] * 2,
            "logged_bytes_per_node_per_step": [link_bytes * 0.9] * 2, "model_bytes_per_node": link_bytes * 0.9,
            "state_bytes_per_rank": [state] * 4, "state_error_bytes_per_rank": [errors] * 4, "loss_reached": 3.0,
            "plan": None, "other_load": 0.01}


def test_table_gives_ratios_against_both_hsdp_rows_of_the_same_link():
    records = [_rec("hsdp_fp32", "1gbit", 0.4, 4000), _rec("hsdp_bf16", "1gbit", 0.3, 2000),
               _rec("lion_1bit", "1gbit", 0.2, 200, errors=0), {"config": "turboquant", "link": "1gbit",
                                                                "failed": True, "timed_out": True}]
    text = nodes_sharded.table(records)
    row = next(line for line in text.splitlines() if line.startswith("| Lion Cub 1-bit"))
    assert "| 20.00×, 2.00× | 10.00×, 1.50× | – |" in row  # no comm-free row: no fraction of it
    assert "| TurboQuant-Adam (auto form) | – | 1gbit | timed out |" in text
    # with the comm-free row of the link: each row's step time as a fraction of its
    text = nodes_sharded.table([*records, _rec("node_only", "1gbit", 0.16, 0)])
    row = next(line for line in text.splitlines() if line.startswith("| Lion Cub 1-bit"))
    assert "| 20.00×, 2.00× | 10.00×, 1.50× | 0.80 |" in row


def test_projection_resolves_default_forms_and_orders_the_configurations():
    result = nodes_sharded_projection.project()
    for rows in result.values():
        fp32, bf16 = rows["HSDP fp32 all-reduce"], rows["HSDP bf16 all-reduce"]
        for g in nodes_sharded_projection.ASSUME["links_gbps"]:
            assert bf16[g][0] * 2 == pytest.approx(fp32[g][0], rel=1e-6)
            assert rows["Lion Cub 1-bit"][g][1] < rows["TurboQuant-Adam (auto form)"][g][1] < bf16[g][1]
            assert rows["Lion Cub (auto)"][g][2] == "lp8"  # 8-bit lanes hold 8 nodes' codes
    text = nodes_sharded_projection.markdown(result, "No plot.")
    assert text.count("| HSDP bf16 all-reduce |") == len(nodes_sharded_projection.MODELS)


def test_projection_models_have_their_published_sizes():
    models = nodes_sharded_projection.MODELS
    assert models["1.3B (GPT-3 XL shape)"].numel == pytest.approx(1.32e9, rel=0.01)
    assert models["8B (Llama-3 8B shape)"].numel == pytest.approx(8.03e9, rel=0.01)
    unit_params = sum(len(u) for u in models["8B (Llama-3 8B shape)"].units)
    assert unit_params == len(models["8B (Llama-3 8B shape)"].shapes)
    with pytest.raises(ValueError, match="unknown configuration kind"):
        sharded_cost.step_sends("ddp", models["1.3B (GPT-3 XL shape)"], 8, 8)


def test_every_worker_configuration_has_a_label():
    from benchmarks.nodes import sharded, sharded_worker

    assert set(sharded_worker.CONFIGS) <= set(sharded.LABELS), set(sharded_worker.CONFIGS) - set(sharded.LABELS)
    kind, optimizer, fields = sharded_worker.CONFIGS["onebit_lamb"]
    assert (kind, optimizer, fields["algorithm"]) == ("onebit_adam", "onebit_lamb", "onebit_lamb")
