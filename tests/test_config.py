"""LowBitConfig: shared fields, routing into algorithm sections, YAML, environment."""
import dataclasses
import pickle

import pytest

from lowbit_strategy import ConfigError, LowBitConfig
from lowbit_strategy.algorithms import REGISTRY


def test_defaults_are_valid_and_every_registered_algorithm_has_a_section():
    cfg = LowBitConfig()
    assert cfg.algorithm == "lion" and cfg.section is cfg.lion
    assert (cfg.lion.mode, cfg.lion.bits, cfg.lion.p) == ("auto", None, 1.0)
    assert set(cfg.to_dict()) >= set(REGISTRY) and cfg.bitdp.bits == 2
    assert cfg.warmup_wire == "bf16"  # no fp32 phase unless asked


def test_int2_warmup_wire_codes_the_staged_warmups_and_is_refused_elsewhere():
    for algorithm in ("onebit_adam", "onebit_lamb", "turboquant"):
        cfg = LowBitConfig(algorithm=algorithm, warmup_wire="int2")
        assert (cfg.warmup_wire, cfg.exact_wire) == ("int2", "bf16")  # fallbacks and first steps: bf16
    assert LowBitConfig(warmup_wire="fp32").exact_wire == "fp32"
    for algorithm in ("lion", "bitdp"):
        with pytest.raises(ConfigError) as err:
            LowBitConfig(algorithm=algorithm, warmup_wire="int2")
        msg = str(err.value)
        assert "LowBitConfig.warmup_wire" in msg and "'int2'" in msg and "use 'bf16'" in msg, msg
        assert "onebit_adam, onebit_lamb, turboquant" in msg and algorithm in msg


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("algorithm", "lionn", "did you mean 'lion'"),
        ("algorithm", "powersgd", "allowed: lion, bitdp, onebit_adam, onebit_lamb, turboquant"),
        ("bucket_size_mb", 0, "> 0"),
        ("bucket_size_mb", "big", "> 0"),
        ("bucket_size_mb", float("nan"), "finite"),
        ("warmup_steps", -3, "integer >= 0"),
        ("warmup_wire", "int8", "allowed: bf16, fp32, int2"),
        ("link_bandwidth_gbps", -1, "> 0"),
        ("link_latency_us", -1, ">= 0"),
        ("debug", "maybe", "boolean"),
        ("compile_codecs", "sometimes", "boolean"),
    ],
)
def test_every_invalid_shared_value_names_field_value_and_allowed(field, value, allowed):
    with pytest.raises(ConfigError) as err:
        LowBitConfig(**{field: value})
    msg = str(err.value)
    assert f"LowBitConfig.{field}" in msg and repr(value) in msg and allowed in msg
    assert err.value.field == field


def test_keywords_route_to_sections():
    whole = LowBitConfig(algorithm="lion", lion={"mode": "lp", "bits": 8})
    assert whole == LowBitConfig(mode="lp", bits=8) == LowBitConfig(lion_mode="lp", lion_bits=8)
    # <section>_<field> reaches a section that is not active; shorthands go to the active one
    cfg = LowBitConfig(algorithm="bitdp", bits=1, lion_mode="1bit", bitdp_quantize="*.weight, wte.*")
    assert cfg.section is cfg.bitdp and cfg.bitdp.bits == 1 and cfg.lion.mode == "1bit"
    assert cfg.bitdp.quantize == ("*.weight", "wte.*")
    # a shorthand overrides the same field given in a whole section
    assert LowBitConfig(lion={"bits": 8, "mode": "lp"}, bits=16).lion.bits == 16


def test_unknown_keys_name_the_field_and_a_suggestion():
    with pytest.raises(ConfigError, match=r"LowBitConfig\.bit: .*unknown field \(did you mean 'bits'\?\)"):
        LowBitConfig.from_dict({"bit": 4})
    # a field of another section is not a shorthand for the active one
    with pytest.raises(ConfigError, match=r"LowBitConfig\.mode: .*unknown field.*bitdp fields: bits"):
        LowBitConfig(algorithm="bitdp", mode="lp")
    with pytest.raises(ConfigError, match=r"LowBitConfig\.lion\.modee: .*did you mean 'mode'"):
        LowBitConfig(lion={"modee": "lp"})
    with pytest.raises(ConfigError, match=r"LowBitConfig\.lion: got 3; expected a mapping"):
        LowBitConfig(lion=3)
    with pytest.raises(ConfigError, match="expected a mapping"):
        LowBitConfig.from_dict([("bits", 4)])


def test_immutable_comparable_picklable():
    cfg = LowBitConfig(mode="sign", bits=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.algorithm = "bitdp"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lion.mode = "lp"
    assert pickle.loads(pickle.dumps(cfg)) == cfg and cfg != LowBitConfig()
    assert LowBitConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(AttributeError, match="no field or section 'turbo'"):
        cfg.turbo


def test_from_yaml(tmp_path):
    path = tmp_path / "lowbit.yaml"
    path.write_text("algorithm: lion\nlion:\n  mode: lp\n  bits: 8\n  momentum_sync_layers: [lm_head.*]\n"
                    "bitdp:\n  bits: 1\n")
    cfg = LowBitConfig.from_yaml(path)
    assert cfg == LowBitConfig(mode="lp", bits=8, momentum_sync_layers=("lm_head.*",), bitdp_bits=1)
    flat = tmp_path / "flat.yaml"
    flat.write_text("lowbit:\n  mode: 1bit\n")  # shorthands and a top-level lowbit: key work too
    assert LowBitConfig.from_yaml(flat).lion.mode == "1bit"
    bad = tmp_path / "bad.yaml"
    bad.write_text("lion:\n  mode: lp\n  bits: 3\n")
    with pytest.raises(ConfigError, match=r"LowBitConfig\.lion\.bits: got 3"):
        LowBitConfig.from_yaml(bad)


def test_malformed_or_missing_yaml_names_the_file(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("lion:\n  mode: [lp\n  bits: 8\n")
    with pytest.raises(ConfigError, match=r"LowBitConfig\.<file>: got '.*broken\.yaml'; not valid YAML at line \d+"):
        LowBitConfig.from_yaml(broken)
    with pytest.raises(ConfigError, match=r"got '.*nope\.yaml'; cannot read the YAML file"):
        LowBitConfig.from_yaml(tmp_path / "nope.yaml")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("just text\n")
    with pytest.raises(ConfigError, match="expected a mapping of field names to values, got a str"):
        LowBitConfig.from_yaml(scalar)


def test_from_env(tmp_path):
    env = {"LOWBIT_MODE": "sign", "LOWBIT_BITS": "4", "LOWBIT_DEBUG": "1", "LOWBIT_BITDP_BITS": "1", "PATH": "/bin"}
    cfg = LowBitConfig.from_env(env)
    assert (cfg.lion.mode, cfg.lion.bits, cfg.debug, cfg.bitdp.bits) == ("sign", 4, True, 1)
    with pytest.raises(ConfigError, match="unknown variable LOWBIT_BTIS"):
        LowBitConfig.from_env({"LOWBIT_BTIS": "4"})
    # LOWBIT_CONFIG names a YAML file; variables override it, section by field
    path = tmp_path / "lowbit.yaml"
    path.write_text("algorithm: bitdp\nbitdp:\n  bits: 1\n  reduction: paper\n")
    cfg = LowBitConfig.from_env({"LOWBIT_CONFIG": str(path), "LOWBIT_BITS": "2"})
    assert (cfg.algorithm, cfg.bitdp.bits, cfg.bitdp.reduction) == ("bitdp", 2, "paper")
    with pytest.raises(ConfigError, match=r"LowBitConfig\.bitdp\.bits: got '3'"):
        LowBitConfig.from_env({"LOWBIT_ALGORITHM": "bitdp", "LOWBIT_BITS": "3"})


def test_coerce_and_replace(tmp_path):
    base = LowBitConfig(mode="lp", bits=8)
    assert LowBitConfig.coerce(base, bits=16).lion.bits == 16
    assert LowBitConfig.coerce({"mode": "1bit"}).lion.mode == "1bit"
    assert LowBitConfig.coerce(None) == LowBitConfig()
    path = tmp_path / "c.yaml"
    path.write_text("mode: fp32\n")
    assert LowBitConfig.coerce(str(path)).lion.mode == "fp32"
    assert base.replace(mode="sign", bits=4).lion.mode == "sign"
    assert base.replace(algorithm="bitdp").bitdp.bits == 2 and base.replace(algorithm="bitdp").lion.bits == 8
    with pytest.raises(ConfigError, match="expected a LowBitConfig"):
        LowBitConfig.coerce(42)
