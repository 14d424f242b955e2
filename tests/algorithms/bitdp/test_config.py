"""BitDP's config section: every field validated where it is defined."""
import pytest

from lowbit_strategy import ConfigError, LowBitConfig
from lowbit_strategy.algorithms.bitdp import BitDPConfig


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("bits", 4, "1 or 2 bits"),
        ("bits", True, "integer >= 1"),
        ("error_feedback", "sometimes", "boolean"),
        ("quantize", [], "list of parameter-name patterns"),
        ("exclude", 3, "list of parameter-name patterns"),
        ("reduction", "median", "allowed: mean, paper"),
    ],
)
def test_every_invalid_value_names_field_value_and_allowed(field, value, allowed):
    for build in (lambda: LowBitConfig(algorithm="bitdp", **{field: value}),
                  lambda: LowBitConfig(**{f"bitdp_{field}": value}), lambda: BitDPConfig(**{field: value})):
        with pytest.raises(ConfigError) as err:
            build()
        msg = str(err.value)
        assert f"LowBitConfig.bitdp.{field}" in msg and repr(value) in msg and allowed in msg


def test_fields_are_converted():
    cfg = LowBitConfig(algorithm="bitdp", bits="1", quantize="*.weight, wte.*", reduction="PAPER",
                       error_feedback="yes").bitdp
    assert (cfg.bits, cfg.quantize, cfg.exclude, cfg.reduction, cfg.error_feedback) == \
        (1, ("*.weight", "wte.*"), None, "paper", True)
    assert LowBitConfig(algorithm="bitdp", bits=None).bitdp.bits == 2
