"""lowbit-plan: the table and JSON from a parameter count and from a Hugging Face config, the
recommendation on fast and slow links, and bad inputs named. Fast: arithmetic only."""

import json

import pytest
import torch

from lowbit_strategy.plan import cli, inputs, predict, recommend

SMALL = ["--params", "1e8", "--nodes", "2", "--gpus-per-node", "4", "--compute-s", "0.5"]
LLAMA3_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}


def _run(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_table_from_a_parameter_count(capsys, monkeypatch):
    from lowbit_strategy.plan import cli

    # without a GPU codec report (the repository holds one from an H100: tested below)
    monkeypatch.setattr(cli, "GPU_CODECS", cli.GPU_CODECS.with_name("absent.json"))
    code, out, _ = _run(capsys, *SMALL, "--link", "1gbit")
    assert code == 0
    methods = ("DDP fp32", "DDP bf16", "PowerSGD rank 4", "Lion Cub", "1-bit Adam", "1-bit LAMB", "TurboQuant", "BitDP")
    for method in methods:
        assert method in out
    assert "hierarchical" in out and "overlap:" in out and "codec time not counted" in out
    assert out.strip().splitlines()[-1].startswith("Use ")


def test_the_h100_codec_report_reads_back(capsys, monkeypatch):
    """The H100's report (benchmarks/results/gpu/codecs_h100.json, by make gpu-check) prices
    the low-bit rows' codecs; without any report the table says codec time is not counted."""
    from lowbit_strategy.plan import cli

    monkeypatch.setattr(cli, "GPU_CODECS", cli.GPU_CODECS.with_name("absent.json"))
    h100 = cli.GPU_CODECS.with_name("codecs_h100.json")
    code, out, _ = _run(capsys, *SMALL, "--link", "1gbit", "--codecs", str(h100))
    assert code == 0 and "codec times from codecs_h100.json (NVIDIA H100" in out, out


def test_json_from_a_hf_config(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    argv = ["--hf-config", str(path), "--nodes", "8", "--gpus-per-node", "8", "--link", "25gbit"]
    code, out, _ = _run(capsys, *argv, "--gpu", "h100", "--tokens-per-step", "4e6", "--sharded", "--json")
    assert code == 0
    plan = json.loads(out)
    rows = {r["key"]: r for r in plan["rows"]}
    assert {"ddp_fp32", "ddp_bf16", "powersgd", "turboquant_hierarchical", "hsdp_bf16", "onebit_sharded"} <= set(rows)
    assert rows["ddp_bf16"]["speedup"] == pytest.approx(1.0)
    # bf16 sends half of fp32's bytes; the sharded path divides the optimizer state by L
    assert rows["ddp_bf16"]["link_bytes"] == pytest.approx(rows["ddp_fp32"]["link_bytes"] / 2, rel=1e-3)
    assert rows["onebit_sharded"]["memory_bytes"] < rows["onebit_flat"]["memory_bytes"] / 7
    assert "8,030,261,248 params" in plan["assumptions"][0]  # Llama-3-8B's published size
    assert "h100" in plan["assumptions"][2] and plan["recommendation"]
    # 8 B/param of weights and gradients plus AdamW's 8 B: DDP does not fit 80 GB; the sharded rows do
    assert rows["ddp_bf16"]["fits"] is False and rows["hsdp_bf16"]["fits"] is True
    assert "sharded" in plan["recommendation"] or "HSDP" in plan["recommendation"]


def test_model_sizes():
    gpt2 = {"n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}
    assert inputs.from_params(8e9).numel == 8_000_000_000
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "gpt2.json"
        p.write_text(json.dumps(gpt2))
        model = inputs.from_hf_config(p)
    assert model.numel == 124_439_808  # GPT-2 small
    assert len(model.units) == 13  # 12 blocks + the rest


@pytest.mark.parametrize(
    ("link", "ddp"),
    [("3200gbit", True), ("100mbit", False)],
)
def test_recommendation_flips_with_the_link(link, ddp):
    args = cli.parser().parse_args([*SMALL, "--link", link])
    rows = predict.predict(cli.setup_from(args))
    sentence = recommend.recommend(rows)
    assert sentence.startswith("Use DDP with bf16 communication") == ddp, sentence
    if not ddp:
        best = min(rows, key=lambda r: r.step_s)
        assert best.speedup > 2 and not best.key.startswith("ddp")


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--link", "fast"], "--link: got 'fast'"),
        (["--gpu", "tpu9", "--tokens-per-step", "1e6"], "--gpu: got 'tpu9'"),
        (["--nodes", "0"], "--nodes/--gpus-per-node"),
    ],
)
def test_bad_inputs_name_the_option(capsys, argv, named):
    base = ["--params", "1e8", *([] if "--gpu" in argv else ["--compute-s", "1"])]
    code, _, err = _run(capsys, *base, *argv)
    assert code == 2 and named in err


def test_bad_hf_config_names_the_key(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 64}))
    code, _, err = _run(capsys, "--hf-config", str(path), "--compute-s", "1")
    assert code == 2 and "missing num_hidden_layers" in err


def test_rates():
    assert inputs.parse_rate("--link", "25gbit") == 25
    assert inputs.parse_rate("--link", "100mbit") == pytest.approx(0.1)
    assert inputs.parse_rate("--link", "3.2tbit") == pytest.approx(3200)
    assert inputs.parse_rate("--link", "400Gbps") == 400


def test_codec_times_from_a_report(tmp_path, capsys):
    report = tmp_path / "codecs.json"
    report.write_text(json.dumps({"device": "NVIDIA H100", "ns_per_element": {"turboquant": 0.05, "lp": 0.02}}))
    code, out, _ = _run(capsys, *SMALL, "--link", "1gbit", "--codecs", str(report), "--json")
    plan = json.loads(out)
    assert code == 0 and any("codecs.json (NVIDIA H100)" in a for a in plan["assumptions"])
    rows = {r["key"]: r for r in plan["rows"]}
    assert rows["lion_lp8_flat"]["codec_s"] == pytest.approx(0.02e-9 * 1e8, rel=1e-3)  # every element, flat
    assert rows["ddp_bf16"]["codec_s"] == 0
    report.write_text("{}")
    code, _, err = _run(capsys, *SMALL, "--codecs", str(report))
    assert code == 2 and "--codecs" in err


def test_asked_for_a_measurement_the_plan_does_not_read_the_default_report(capsys, monkeypatch):
    """A checkout holds a GPU's codecs.json, read by default; ``--measure-codecs`` must time this
    machine instead (it was silently ignored), and with ``--codecs`` too it is an error."""
    from lowbit_strategy.plan import measure

    assert cli.GPU_CODECS.exists()
    monkeypatch.setattr(measure, "measure_codecs", lambda processes=1: ({"lp": 7.0}, f"cpu x{processes}"))
    code, out, _ = _run(capsys, *SMALL, "--link", "1gbit", "--measure-codecs", "--codec-processes", "4", "--json")
    plan = json.loads(out)
    assert code == 0 and "measured on this machine's cpu x4" in plan["assumptions"][4]
    rows = {r["key"]: r for r in plan["rows"]}
    assert rows["lion_lp8_flat"]["codec_s"] == pytest.approx(7e-9 * 1e8, rel=1e-3)
    code, _, err = _run(capsys, *SMALL, "--codecs", str(cli.GPU_CODECS), "--measure-codecs")
    assert code == 2 and "either --codecs or --measure-codecs" in err


def test_optimizer_steps_and_turboquant_forms_priced_from_the_report(tmp_path, capsys):
    """1-bit LAMB's step beyond AdamW's lands on its rows only, over every parameter; with
    TurboQuant's encode and decode apart, each form counts them as the algorithm's plan does."""
    ns = {"onebit_adam_step": 1.0, "onebit_lamb_step": 3.0, "turboquant_encode": 2.0, "turboquant_decode": 1.0}
    report = tmp_path / "codecs.json"
    report.write_text(json.dumps({"device": "test", "ns_per_element": ns}))
    code, out, _ = _run(capsys, *SMALL, "--link", "100mbit", "--codecs", str(report), "--json")
    rows = {r["key"]: r for r in json.loads(out)["rows"]}
    assert code == 0
    for form in ("flat", "hierarchical"):
        assert rows[f"onebit_{form}"]["codec_s"] == pytest.approx(1e-9 * 1e8)
        assert rows[f"onebit_lamb_{form}"]["codec_s"] == pytest.approx(3e-9 * 1e8)
        assert rows[f"onebit_lamb_{form}"]["link_bytes"] == rows[f"onebit_{form}"]["link_bytes"]
    # P = 8: allgather 1 encode + 8 decodes; two-stage 1.125 encodes + 2.125 decodes (no adds given)
    assert predict.turboquant_codec_ns(ns, "turboquant_allgather", 8) == pytest.approx(2 + 8)
    assert predict.turboquant_codec_ns(ns, "turboquant_two_stage", 8) == pytest.approx(2.25 + 2.125)
    assert predict.turboquant_codec_ns(ns, "fp32", 8) == 0
    assert predict.turboquant_codec_ns({"turboquant": 5.0}, "turboquant_two_stage", 8) == 5.0  # older reports


def test_measured_codecs_name_every_figure():
    """Every key the planner reads, from a tiny sample on this CPU (one process)."""
    from lowbit_strategy.plan.measure import OPTIMIZER_STEPS, measure_codecs

    ns, device = measure_codecs("cpu", sample=4096)
    keys = {"lp", "1bit", "compensated", "turboquant", "turboquant_encode", "turboquant_decode", "add", "blockwise"}
    assert keys | {"bitdp", "powersgd", *OPTIMIZER_STEPS} <= set(ns) and "CPU" in device
    assert all(v >= 0 for v in ns.values())


@pytest.mark.slow
def test_contended_codecs_run_in_that_many_processes():
    from lowbit_strategy.plan.measure import measure_codecs

    ns, device = measure_codecs("cpu", sample=4096, processes=2)
    assert "2 one-thread processes" in device and ns["turboquant_encode"] > 0


def test_world_rows_for_a_model_that_does_not_fit_a_node():
    """--sharded on several nodes adds FSDP over every rank, exact bf16 and int4 in two hops,
    with cost_model_world's bytes; a 70 B model on 8 x 8 H100 fits only that way."""
    from lowbit_strategy.pricing import world as cw

    argv = ["--params", "7e10", "--nodes", "8", "--gpus-per-node", "8", "--link", "25gbit", "--compute-s", "10"]
    setup = cli.setup_from(cli.parser().parse_args([*argv, "--gpu", "h100", "--sharded"]))
    rows = {r.key: r for r in predict.predict(setup)}
    bf16, int4 = rows["fsdp_world_bf16"], rows["fsdp_world_int4"]
    units = setup.model.unit_shapes()
    exact = cw.world_sends(units, 8, 8, reduce_scatter="bf16", param_itemsize=2, reduce_itemsize=2)
    assert bf16.link_bytes == exact.link and bf16.form == int4.form == "world"
    # fewer bytes; the same state (fsdp_error_feedback is off by default)
    assert int4.link_bytes < bf16.link_bytes and int4.memory_bytes == bf16.memory_bytes
    assert bf16.fits and int4.fits and rows["hsdp_bf16"].fits is False and rows["ddp_bf16"].fits is False
    sentence = recommend.recommend(list(rows.values()))
    assert "fsdp_shard='world'" in sentence, sentence
    # one node: no world rows (FSDP inside the node is the sharded rows' layout)
    one = cli.setup_from(cli.parser().parse_args([*argv[:2], "--nodes", "1", "--compute-s", "1", "--sharded"]))
    assert not any(r.form == "world" for r in predict.predict(one))


def test_gpu_check_writes_codecs_the_planner_reads(tmp_path, capsys):
    """benchmarks/gpu_check.py's codecs.json, read back by lowbit-plan --codecs (the format only)."""
    from benchmarks.gpu_check import write_codecs

    path = tmp_path / "gpu" / "codecs.json"
    write_codecs({"lp": 0.02, "turboquant_encode": 0.01, "turboquant_decode": 0.01}, "NVIDIA H100", path)
    code, out, _ = _run(capsys, *SMALL, "--link", "1gbit", "--codecs", str(path), "--json")
    plan = json.loads(out)
    assert code == 0 and any("codecs.json (NVIDIA H100)" in a for a in plan["assumptions"])
    rows = {r["key"]: r for r in plan["rows"]}
    assert rows["lion_lp8_flat"]["codec_s"] == pytest.approx(0.02e-9 * 1e8, rel=1e-3)


@pytest.mark.parametrize(
    "cuda, gpus, local_rank, local_world, backend, device",
    [(False, 0, 1, 2, "gloo", None), (True, 4, 3, 4, "nccl", 3), (True, 8, 1, 2, "nccl", 1),
     (True, 1, 1, 2, "cpu:gloo,cuda:gloo", 0), (True, 2, 3, 4, "cpu:gloo,cuda:gloo", 1)],
)
def test_measure_joins_nccl_only_with_a_gpu_per_local_rank(monkeypatch, cuda, gpus, local_rank, local_world,
                                                          backend, device):
    """``lowbit-plan --measure`` under a launcher: NCCL refuses two ranks on one GPU, so ranks
    that share GPUs measure over gloo with CUDA tensors instead of failing."""
    from lowbit_strategy.plan import measure

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    assert measure._backend() == backend
    assert chosen == ([] if device is None else [device])


def test_diloco_rows_price_one_exchange_per_round_and_carry_a_quality_caveat():
    from lowbit_strategy.algorithms.diloco.exchange import payload_bytes
    from lowbit_strategy.collectives import wire

    # 2 nodes x 4 GPUs: a worker is a node; each local rank sends a quarter over its own cross-node group
    args = cli.parser().parse_args([*SMALL, "--link", "100mbit", "--diloco-sync-every", "50"])
    setup = cli.setup_from(args)
    rows = {r.key: r for r in predict.predict(setup)}
    n = setup.model.numel
    fp32 = rows["diloco_fp32_hierarchical"]
    assert fp32.link_bytes == pytest.approx(4 * wire.allreduce_bytes(4 * -(-n // 4), 2) / 50)
    assert rows["diloco_int4_hierarchical"].link_bytes == pytest.approx(4 * payload_bytes("int4", -(-n // 4), 2) / 50)
    assert rows["diloco_sign_hierarchical"].link_bytes < rows["diloco_int4_hierarchical"].link_bytes < fp32.link_bytes
    # inner AdamW 8 B + the global copy and outer momentum 8 B (+ a 4 B error buffer below 32 bits)
    assert fp32.memory_bytes == 16 * n and rows["diloco_int4_hierarchical"].memory_bytes == 20 * n
    stream = rows["diloco_streaming_int4_hierarchical"]  # the same bytes, partly hidden behind its delay
    assert stream.link_bytes == pytest.approx(rows["diloco_int4_hierarchical"].link_bytes, rel=1e-3)
    assert stream.exposed_s < rows["diloco_int4_hierarchical"].exposed_s
    # at 100 Mbit/s DiLoCo is predicted fastest, but its loss is not priced: named after the choice, with the caveat
    sentence = recommend.recommend(list(rows.values()))
    assert not sentence.startswith(("Use DiLoCo", "Use DeMo")) and "effect on the loss is not priced" in sentence
    diloco_only = [r for r in rows.values() if not r.key.startswith("demo")]
    assert "DiLoCo's effect on the loss is not priced" in recommend.recommend(diloco_only)
    args = cli.parser().parse_args([*SMALL, "--diloco-sync-every", "0"])
    assert not any(r.key.startswith("diloco") for r in predict.predict(cli.setup_from(args)))


def test_demo_rows_all_gather_the_codecs_payload_every_step_and_carry_a_quality_caveat():
    from lowbit_strategy.codecs.topk import layout
    from lowbit_strategy.collectives import wire

    # 2 nodes x 4 GPUs: a worker is a node; its payload leaves once per step, to the other node
    args = cli.parser().parse_args([*SMALL, "--link", "100mbit"])
    setup = cli.setup_from(args)
    rows = {r.key: r for r in predict.predict(setup)}
    n = setup.model.numel
    sign = rows["demo_sign_k32_hierarchical"]
    assert sign.link_bytes == wire.all_gather_bytes(layout(setup.model.shapes, 64, 32, "sign")[1], 2)
    assert rows["demo_fp32_k32_hierarchical"].link_bytes > sign.link_bytes > rows["demo_sign_k8_d1_hierarchical"].link_bytes
    assert sign.memory_bytes == 4 * n  # the momentum is the only state
    late = rows["demo_sign_k8_d1_hierarchical"]  # delay 1: behind the next step's compute
    assert late.exposed_s == max(0.0, late.comm_s - setup.compute.seconds)
    # the all-gather's bytes grow with the workers: 4 nodes send 3 payloads each where 2 send one
    args = cli.parser().parse_args([*SMALL, "--link", "100mbit", "--nodes", "4"])
    four = {r.key: r for r in predict.predict(cli.setup_from(args))}
    assert four["demo_sign_k32_hierarchical"].link_bytes == 3 * sign.link_bytes
    assert "DeMo's effect on the loss is not priced" in recommend._caveat(sign)
