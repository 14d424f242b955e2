"""Every codec step held to its operator budget per bucket (the GPU codecs issue: at most 10
launches per bucket per codec step), counted on the CUDA code paths run under Triton's
interpreter (:mod:`benchmarks.codecs.host_ops`), so a CPU-only CI guards what a GPU would issue."""

import json
import os
import subprocess
import sys

import pytest

from tests.codecs.triton_checks import need_triton

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def counted() -> dict:
    from lowbit_strategy.codecs import triton_launch

    need_triton(triton_launch)  # (fails without triton unless LOWBIT_ALLOW_NO_TRITON=1)
    r = subprocess.run([sys.executable, "-m", "benchmarks.codecs.host_ops", "--json", "--numel", "65536"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])  # (imported here, it would set TRITON_INTERPRET)


def test_every_codec_step_within_its_budget(counted):
    got = {(name, step): v for name, steps in counted["counts"].items() for step, v in steps.items()}
    budgets = {(name, step): b for name, steps in counted["budgets"].items() for step, b in steps.items()}
    assert set(got) == set(budgets), "a codec step without a budget, or a budget without a step"
    assert all(b <= 45 for b in budgets.values())  # (no budget grows past today's worst without review)
    over = {k: (v[0], budgets[k]) for k, v in got.items() if v[0] > budgets[k]}
    assert not over, f"launches per bucket over budget (got, budget): {over}"


def test_the_fused_kernels_ran(counted):
    # the interpreter really served the CUDA paths: a count of a CPU path would not hold a GPU
    for name, step in (("compensated", "encode"), ("compensated", "server"), ("compensated", "decode"),
                       ("lion_1bit", "server"), ("lion_1bit", "decode"), ("bitdp", "encode"), ("turboquant", "encode")):
        assert counted["counts"][name][step][2] >= 1, (name, step)


def test_lion_lp_quantizes_the_bucket_in_one_chain(counted):
    # on a GPU the bucket's vectors are coded together (lp_quantize_many): 3 launches per vector
    # for its scale, not ~15 (the per-vector chains took 139 launches for this bucket of 9)
    assert counted["counts"]["lion_lp8"]["encode"][0] <= 3 * 9 + 18


def test_one_bit_adam_codec_steps_meet_the_goal(counted):
    # 1-bit Adam/LAMB's compensated allreduce: signs, packing and error feedback fused (was 12
    # launches per bucket for the worker's compress and 15 for the server step)
    goal = counted["goal"]
    assert goal == 10
    assert all(counted["counts"]["compensated"][step][0] <= goal for step in ("encode", "server", "decode"))
