"""The 1-bit Adam / LAMB config sections: defaults, every way in, and errors that name the field."""
import pytest

from lowbit_strategy import ConfigError, LowBitConfig


def test_defaults_and_shorthand():
    cfg = LowBitConfig(algorithm="onebit_lamb", overlap=False)
    assert (cfg.onebit_lamb.overlap, cfg.onebit_lamb.scale_block) == (False, 32768)
    assert cfg.onebit_adam.overlap is True  # the other section keeps its defaults
    assert LowBitConfig(algorithm="onebit_adam", onebit_adam_scale_block="none").onebit_adam.scale_block is None


def test_yaml_and_environment(tmp_path, monkeypatch):
    path = tmp_path / "lowbit.yaml"
    path.write_text("algorithm: onebit_adam\nonebit_adam:\n  scale_block: 1024\n")
    assert LowBitConfig.from_yaml(path).onebit_adam.scale_block == 1024
    monkeypatch.setenv("LOWBIT_ALGORITHM", "onebit_adam")
    monkeypatch.setenv("LOWBIT_ONEBIT_ADAM_OVERLAP", "false")
    assert LowBitConfig.from_env().onebit_adam.overlap is False


@pytest.mark.parametrize("value, message", [(12, "multiple of 8"), (0, ">= 8"), ("big", "integer")])
def test_bad_scale_block_names_the_field(value, message):
    with pytest.raises(ConfigError, match=rf"LowBitConfig\.onebit_adam\.scale_block: got .*{message}"):
        LowBitConfig(algorithm="onebit_adam", scale_block=value)
