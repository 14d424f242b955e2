"""gpu-check parts 2 (codec speed) and 4 (where the time goes) in --cpu mode: every codec and
algorithm gets finite figures, and the break-even link speed agrees with the projection rows."""

import math
import types

import pytest
import torch

from benchmarks.gpu_check import codec_speed, where_time


def _args(tmp_path):
    return types.SimpleNamespace(cpu=True, out=tmp_path, steps=8)


@pytest.mark.slow
def test_codec_speed_cpu_gives_finite_figures_for_every_codec(tmp_path):
    part = codec_speed.run(_args(tmp_path))
    assert part.passed, part.failures
    names = [name for name, _, _ in codec_speed._codecs(cuda=False)]
    assert set(part.data["codecs"]) == set(names)
    for name, steps in part.data["codecs"].items():
        assert steps, name
        for step, sizes in steps.items():
            for n in part.data["sizes"]:
                fig = sizes[str(n)]
                assert fig["ms"] > 0 and math.isfinite(fig["gbps"]) and fig["x_copy"] > 0, (name, step, n)
        assert f"| {name} |" in part.markdown
    assert all(v > 0 and math.isfinite(v) for v in part.data["ns_per_element"].values())
    assert "not run on CPU" in part.markdown


@pytest.mark.slow
def test_where_time_cpu_projection_and_break_even_agree(tmp_path):
    part = where_time.run(_args(tmp_path))
    assert part.passed, part.failures
    data = part.data
    assert math.isfinite(data["model"]["loss"]) and data["model"]["forward_backward_ms"] > 0
    for codec, steps in data["codec_ms"].items():
        assert steps["total"] > 0 and all(math.isfinite(v) for v in steps.values()), codec
    assert set(data["codec_host"]) == set(data["codec_ms"])
    for codec, host in data["codec_host"].items():  # every codec dispatches torch operators on CPU
        assert host["ops"]["encode"] > 0 and host["ops"]["decode"] > 0, codec
        assert all(v >= 0 and math.isfinite(v) for v in host["issue_ms"].values()), codec
        assert f"| {codec} | {host['ops']['encode']:,} · " in part.markdown, codec
    for p in map(str, where_time.WORLDS):
        proj = data["projection"][p]
        for algo, (_label, row, _) in where_time.ALGOS.items():
            key = row(int(p))
            assert key in proj and f"`{key}`" in part.markdown, (algo, key)
            for link, fig in proj[key].items():
                assert fig["step_ms"] > 0 and math.isfinite(fig["x_bf16"]) and math.isfinite(fig["x_fp32"])
                for ref, ratio in (("ddp_bf16", "x_bf16"), ("ddp_fp32", "x_fp32")):
                    be = data["break_even_gbps"][algo][f"{p}/{ref}"]
                    faster = fig[ratio] > 1 and proj[key][link]["step_ms"] < proj[ref][link]["step_ms"]
                    if be == "pays at every speed tried":
                        assert faster, (algo, p, ref, link)
                    elif be == "never pays":
                        assert not faster, (algo, p, ref, link)
                    else:
                        assert where_time.LOW < be < where_time.HIGH
                        if float(link) > be:  # above the break-even: slower (or equal)
                            assert not faster, (algo, p, ref, link, be)
                        elif float(link) < be:
                            assert faster, (algo, p, ref, link, be)
    assert "stops paying" in part.markdown


def test_op_count_counts_each_torch_operator_call():
    from benchmarks.gpu_check.timing import op_count

    x = torch.ones(8)

    def adds(k):
        def fn():
            y = x
            for _ in range(k):
                y = y + 1
            return y

        return fn

    assert op_count(adds(5)) - op_count(adds(2)) == 3
    assert op_count(lambda: None) == 0
