import math

import pytest

from lowbit_strategy import ConfigError, LowBitConfig


def test_defaults_are_valid():
    cfg = LowBitConfig()
    assert (cfg.algorithm, cfg.mode, cfg.bits, cfg.p) == ("lion", "auto", None, 1.0)


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("algorithm", "lionn", "did you mean 'lion'"),
        ("mode", "2bit", "allowed: auto, 1bit, sign, lp, fp32, bf16"),
        ("p", 3, "allowed: 0, 1, 2, inf"),
        ("p", True, "allowed: 0, 1, 2, inf"),
        ("bucket_size_mb", 0, "> 0"),
        ("bucket_size_mb", "big", "> 0"),
        ("bucket_size_mb", float("nan"), "finite"),
        ("momentum_sync_every", -1, "integer >= 0"),
        ("momentum_sync_every", 2.5, "integer >= 0"),
        ("momentum_sync_every", True, "integer >= 0"),
        ("momentum_sync_layers", 5, "'auto', 'all', 'none'"),
        ("momentum_sync_layers", [], "'auto', 'all', 'none'"),
        ("momentum_sync_layers", ["head", ""], "'auto', 'all', 'none'"),
        ("warmup_steps", -3, "integer >= 0"),
        ("link_bandwidth_gbps", -1, "> 0"),
        ("link_latency_us", -1, ">= 0"),
        ("debug", "maybe", "boolean"),
        ("bitdp_error_feedback", "sometimes", "boolean"),
        ("bitdp_quantize", [], "list of parameter-name patterns"),
        ("bitdp_exclude", 3, "list of parameter-name patterns"),
        ("bitdp_reduction", "median", "allowed: mean, paper"),
    ],
)
def test_every_invalid_value_names_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ConfigError) as err:
        LowBitConfig(**{field: value})
    msg = str(err.value)
    assert f"LowBitConfig.{field}" in msg and repr(value) in msg and allowed in msg
    assert err.value.field == field


@pytest.mark.parametrize(
    "kwargs,ok",
    [
        ({"mode": "1bit", "bits": 1}, True),
        ({"mode": "1bit", "bits": 4}, False),
        ({"mode": "sign", "bits": 4}, True),
        ({"mode": "sign", "bits": 3}, False),
        ({"mode": "lp", "bits": 8}, True),
        ({"mode": "lp", "bits": 1}, False),
        ({"mode": "fp32", "bits": 32}, True),
        ({"mode": "bf16", "bits": 32}, False),
        ({"mode": "auto", "bits": 3}, False),
        ({"algorithm": "bitdp", "bits": 2}, True),
        ({"algorithm": "bitdp", "bits": 4}, False),
        ({"algorithm": "bitdp", "mode": "lp"}, False),
        ({"algorithm": "turboquant_adam", "bits": 4}, True),
        ({"algorithm": "onebit_lamb", "bits": 2}, False),
    ],
)
def test_bits_must_match_algorithm_and_mode(kwargs, ok):
    if ok:
        LowBitConfig(**kwargs)
    else:
        with pytest.raises(ConfigError, match=r"LowBitConfig\.(bits|mode)"):
            LowBitConfig(**kwargs)


def test_bits_alone_pick_the_papers_mode():
    assert [LowBitConfig(bits=b).mode for b in (1, 4, 8, 32)] == ["1bit", "sign", "lp", "fp32"]
    assert LowBitConfig(bits="8").bits == 8


def test_strings_are_converted():
    cfg = LowBitConfig(mode="LP", bits="8", p="inf", bucket_size_mb="4", momentum_sync_every="10",
                       momentum_sync_layers="wte.*, lm_head.*", debug="yes")
    assert cfg.mode == "lp" and cfg.bits == 8 and cfg.p == math.inf and cfg.bucket_size_mb == 4.0
    assert cfg.momentum_sync_every == 10 and cfg.momentum_sync_layers == ("wte.*", "lm_head.*")
    assert cfg.debug is True


def test_bitdp_fields():
    cfg = LowBitConfig(algorithm="bitdp", bits=1, bitdp_quantize="*.weight, wte.*", bitdp_reduction="PAPER")
    assert cfg.bitdp_quantize == ("*.weight", "wte.*") and cfg.bitdp_exclude is None and cfg.bitdp_reduction == "paper"


def test_from_dict_rejects_unknown_keys_with_suggestion():
    with pytest.raises(ConfigError, match=r"LowBitConfig\.bit: .*unknown field \(did you mean 'bits'\?\)"):
        LowBitConfig.from_dict({"bit": 4})
    with pytest.raises(ConfigError, match="expected a mapping"):
        LowBitConfig.from_dict([("bits", 4)])


def test_from_yaml(tmp_path):
    path = tmp_path / "lowbit.yaml"
    path.write_text("mode: lp\nbits: 8\np: 1\nmomentum_sync_layers: [lm_head.*]\n")
    assert LowBitConfig.from_yaml(path) == LowBitConfig(mode="lp", bits=8, momentum_sync_layers=("lm_head.*",))
    nested = tmp_path / "nested.yaml"
    nested.write_text("lowbit:\n  mode: 1bit\n")
    assert LowBitConfig.from_yaml(nested).mode == "1bit"
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: lp\nbits: 3\n")
    with pytest.raises(ConfigError, match=r"LowBitConfig\.bits: got 3"):
        LowBitConfig.from_yaml(bad)


def test_from_env():
    env = {"LOWBIT_MODE": "sign", "LOWBIT_BITS": "4", "LOWBIT_DEBUG": "1", "PATH": "/bin"}
    cfg = LowBitConfig.from_env(env)
    assert (cfg.mode, cfg.bits, cfg.debug) == ("sign", 4, True)
    with pytest.raises(ConfigError, match="unknown variable LOWBIT_BTIS"):
        LowBitConfig.from_env({"LOWBIT_BTIS": "4"})


def test_coerce_and_replace(tmp_path):
    base = LowBitConfig(mode="lp", bits=8)
    assert LowBitConfig.coerce(base, bits=16).bits == 16
    assert LowBitConfig.coerce({"mode": "1bit"}).mode == "1bit"
    assert LowBitConfig.coerce(None) == LowBitConfig()
    path = tmp_path / "c.yaml"
    path.write_text("mode: fp32\n")
    assert LowBitConfig.coerce(str(path)).mode == "fp32"
    assert base.replace(mode="sign", bits=4).mode == "sign"
    with pytest.raises(ConfigError, match="expected a LowBitConfig"):
        LowBitConfig.coerce(42)
