"""The DiLoCo sweep's points: the streaming form's fields reach the run's config and its name."""

import argparse

import pytest

from benchmarks.ttq import diloco_sweep as sweep
from benchmarks.ttq.driver import DILOCO


def test_points_name_the_streaming_form_and_reach_the_config():
    assert sweep.parse_point("50:0.7:0.9") == (50, 0.7, 0.9, 1, 0)
    stream = sweep.parse_point("10:0.7:0.5:2:1")
    assert stream == (10, 0.7, 0.5, 2, 1)
    settings = sweep.settings_of({"lr": 0.00075}, stream, 1, "int4")
    assert settings["seed"] == 1 and settings["lowbit"].endswith(",diloco_fragments=2,diloco_delay=1")
    assert "fragments" not in sweep.settings_of({}, sweep.parse_point("10:0.7:0.5"), 0, "int4")["lowbit"]
    assert sweep.name_of(stream, 1, "int4") == "int4_h10_olr0.7_om0.5_f2_d1_seed1"
    # its step time is the study's timing run of the same form, which the driver knows
    assert sweep.timing_name("int4", stream) == "lowbit_diloco_stream_int4_h10" in DILOCO
    assert sweep.timing_name("sign", sweep.parse_point("10:0.7:0.5")) == "lowbit_diloco_sign_h10" in DILOCO
    assert sweep.timing_name("int4", sweep.parse_point("10:0.7:0.5:2:4")) == "lowbit_diloco_stream_int4_h10_d4" in DILOCO
    for bad in ("10:0.7", "10:0.7:0.5:2", "x:0.7:0.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="H:outer_lr:outer_momentum"):
            sweep.parse_point(bad)


def test_the_inner_lr_reaches_the_settings_and_the_name():
    point = sweep.parse_point("10:0.7:0.5")
    assert sweep.settings_of({"lr": 0.00075}, point, 0, "int4", 0.0005)["lr"] == 0.0005
    assert sweep.settings_of({"lr": 0.00075}, point, 0, "int4")["lr"] == 0.00075
    assert sweep.name_of(point, 0, "int4", 0.0005) == "int4_h10_olr0.7_om0.5_ilr0.0005_seed0"
