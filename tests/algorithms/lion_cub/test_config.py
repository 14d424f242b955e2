"""Lion Cub's config section: every field validated where it is defined."""
import math

import pytest

from lowbit_strategy import ConfigError, LowBitConfig
from lowbit_strategy.algorithms.lion_cub import LionConfig


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("mode", "2bit", "allowed: auto, 1bit, sign, lp, fp32, bf16"),
        ("p", 3, "allowed: 0, 1, 2, inf"),
        ("p", True, "allowed: 0, 1, 2, inf"),
        ("momentum_sync_every", -1, "integer >= 0"),
        ("momentum_sync_every", 2.5, "integer >= 0"),
        ("momentum_sync_every", True, "integer >= 0"),
        ("momentum_sync_layers", 5, "'auto', 'all', 'none'"),
        ("momentum_sync_layers", [], "'auto', 'all', 'none'"),
        ("momentum_sync_layers", ["head", ""], "'auto', 'all', 'none'"),
    ],
)
def test_every_invalid_value_names_field_value_and_allowed(field, value, allowed):
    for build in (lambda: LowBitConfig(**{field: value}), lambda: LionConfig(**{field: value})):
        with pytest.raises(ConfigError) as err:
            build()
        msg = str(err.value)
        assert f"LowBitConfig.lion.{field}" in msg and repr(value) in msg and allowed in msg
        assert err.value.field == f"lion.{field}"


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
    ],
)
def test_bits_must_match_the_mode(kwargs, ok):
    if ok:
        LowBitConfig(**kwargs)
    else:
        with pytest.raises(ConfigError, match=r"LowBitConfig\.lion\.bits: got \d+; with mode="):
            LowBitConfig(**kwargs)


def test_bits_alone_pick_the_papers_mode():
    assert [LowBitConfig(bits=b).lion.mode for b in (1, 4, 8, 32)] == ["1bit", "sign", "lp", "fp32"]
    assert LowBitConfig(bits="8").lion.bits == 8


def test_strings_are_converted():
    cfg = LowBitConfig(mode="LP", bits="8", p="inf", bucket_size_mb="4", momentum_sync_every="10",
                       momentum_sync_layers="wte.*, lm_head.*", debug="yes").lion
    assert cfg.mode == "lp" and cfg.bits == 8 and cfg.p == math.inf
    assert cfg.momentum_sync_every == 10 and cfg.momentum_sync_layers == ("wte.*", "lm_head.*")
