"""TurboQuant-Adam's config section: defaults, every way in, errors that name the field, and
the registry entry (strategy names, wrong optimizer, precision)."""
import pytest

import lowbit_strategy
from lowbit_strategy import ALGORITHMS, ConfigError, LowBitConfig, LowBitSetupError


def test_defaults_and_shorthand():
    cfg = LowBitConfig(algorithm="turboquant", form="two_stage")
    section = cfg.turboquant
    assert (section.overlap, section.form, section.block, section.seed) == (True, "two_stage", 1024, 0)
    assert LowBitConfig(algorithm="turboquant").turboquant.form == "auto"


def test_yaml_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "lowbit.yaml"
    path.write_text("algorithm: turboquant\nturboquant:\n  block: 256\n  form: allgather\n")
    cfg = LowBitConfig.from_yaml(path)
    assert (cfg.turboquant.block, cfg.turboquant.form) == (256, "allgather")
    monkeypatch.setenv("LOWBIT_ALGORITHM", "turboquant")
    monkeypatch.setenv("LOWBIT_TURBOQUANT_OVERLAP", "false")
    assert LowBitConfig.from_env().turboquant.overlap is False


@pytest.mark.parametrize("field, value, message", [
    ("block", 1000, "power of two"), ("block", 1, ">= 2"), ("form", "ring", "allowed: auto, allgather, two_stage"),
    ("seed", -1, ">= 0"),
])
def test_bad_fields_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=rf"LowBitConfig\.turboquant\.{field}: got .*{message}"):
        LowBitConfig(algorithm="turboquant", **{field: value})


def test_registry_entry():
    algo = ALGORITHMS["turboquant"]
    assert "lowbit_turboquant" in algo.strategy_names
    assert {"lowbit_turboquant", "lowbit_turboquant_spawn", "lowbit_turboquant_notebook"} <= set(
        lowbit_strategy.STRATEGY_NAMES)
    with pytest.raises(LowBitSetupError, match="bf16-mixed"):
        algo.check_precision("16-mixed")
    algo.check_precision("bf16-mixed")


def test_communicator_refuses_an_unknown_form():
    from lowbit_strategy.algorithms.turboquant.communicator import TurboQuantCommunicator

    with pytest.raises(ValueError, match=r"form must be one of .*'two_stage'.*got 'twostage'"):
        TurboQuantCommunicator(form="twostage")
