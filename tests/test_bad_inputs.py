"""Every input checked where it enters: one table of bad inputs across keyword arguments, YAML
files, the environment, the optimizers and the layers. Each row asserts the exception type
and that the message names the field (and, for config values, that a huge value is shown
shortened)."""

import decimal
import math

import numpy as np
import pytest
import torch
from torch import nn

from lowbit_strategy import ConfigError, Lion, LowBitConfig, OneBitAdam, OneBitLamb, TurboQuantAdamW
from lowbit_strategy.nn import TurboQuantLinear, compress_activations

INF, NAN = math.inf, math.nan

#: (field as the message names it, keyword arguments of LowBitConfig)
CONFIG = [
    ("algorithm", dict(algorithm="powersgd")),
    ("algorithm", dict(algorithm=3)),
    *[("bucket_size_mb", dict(bucket_size_mb=v)) for v in (0, -1, NAN, INF, 1e308, True, "big", None)],
    *[("warmup_steps", dict(warmup_steps=v)) for v in (-1, 1.5, INF, NAN, np.float32(8.5), "x", True,
                                                      decimal.Decimal("2.5"), torch.tensor(2.5), 2**70)],
    *[("link_bandwidth_gbps", dict(link_bandwidth_gbps=v)) for v in (0, -1, NAN, INF, "fast")],
    *[("link_latency_us", dict(link_latency_us=v)) for v in (-1, NAN, INF)],
    *[("debug", dict(debug=v)) for v in ("maybe", 2, 0.5)],
    *[("compile_codecs", dict(compile_codecs=v)) for v in ("maybe", 2, 0.5)],
    *[("topology", dict(topology=v)) for v in ("tree", 2, "", True)],
    *[("ranks_per_node", dict(ranks_per_node=v)) for v in (0, -2, 1.5, INF, NAN, "two", True, 2**40)],
    *[("lion.mode", dict(mode=v)) for v in ("2bit", 4, "")],
    *[("lion.bits", dict(mode=m, bits=b)) for m, b in (("lp", 2), ("lp", 3), ("sign", 64), ("1bit", 8),
                                                       ("fp32", 16), ("bf16", 32))],
    *[("lion.bits", dict(bits=v)) for v in (8.5, np.float32(8.5), 3, -1, True)],
    *[("lion.p", dict(p=v)) for v in (3, -1, NAN, "one", True)],
    *[("lion.momentum_sync_every", dict(momentum_sync_every=v)) for v in (-1, 1.5, INF, True)],
    *[("lion.momentum_sync_layers", dict(momentum_sync_layers=v)) for v in (5, [], [""], [3])],
    ("lion.overlap", dict(lion={"overlap": "sometimes"})),
    ("lion.color", dict(lion={"color": "red"})),
    *[("bitdp.bits", dict(bitdp_bits=v)) for v in (3, 0, 8, 1.5, "two")],
    ("bitdp.reduction", dict(bitdp_reduction="sum")),
    ("bitdp.quantize", dict(bitdp_quantize=[])),
    ("bitdp.error_feedback", dict(bitdp_error_feedback="perhaps")),
    *[("bitdp.form", dict(bitdp_form=v)) for v in ("three", 2)],
    *[("onebit_adam.scale_block", dict(onebit_adam_scale_block=v)) for v in (4, 12, -8, 8.5, True)],
    ("onebit_lamb.overlap", dict(onebit_lamb_overlap=3)),
    *[("turboquant.form", dict(turboquant_form=v)) for v in ("three", 2)],
    *[("turboquant.block", dict(turboquant_block=v)) for v in (3, 1, 1.5, 2**30)],
    *[("turboquant.seed", dict(turboquant_seed=v)) for v in (-1, 2**70, 1.5, True)],
    ("colour", dict(colour="red")),
]

#: (field, YAML text)
YAML = [
    ("'bits' is given twice", "lion:\n  bits: 8\n  mode: lp\n  bits: 4\n"),  # a key given twice
    ("algorithm", "algorithm: lion\nalgorithm: bitdp\n"),
    ("anchors", "a: &a [1, 1, 1]\nb: &b [*a, *a, *a]\nc: [*b, *b, *b]\n"),  # nested aliases
    ("not valid YAML", "lion: [unclosed\n"),
    ("expected a mapping", "- just\n- a list\n"),
    ("bucket_size_mb", "bucket_size_mb: .inf\n"),
    ("warmup_steps", "warmup_steps: 2.5\n"),
    ("lion.mode", "lion:\n  mode: 3bit\n"),
    ("bitdp.bits", "algorithm: bitdp\nbitdp: {bits: 4}\n"),
    ("turboquant.seed", "turboquant: {seed: -3}\n"),
    ("lion", "lion: 5\n"),
]

#: (field, environment)
ENV = [
    ("bits", {"LOWBIT_BITS": "8.5"}),
    ("lion.bits", {"LOWBIT_LION_BITS": "huge"}),
    ("bucket_size_mb", {"LOWBIT_BUCKET_SIZE_MB": "inf"}),
    ("warmup_steps", {"LOWBIT_WARMUP_STEPS": "-2"}),
    ("debug", {"LOWBIT_DEBUG": "perhaps"}),
    ("compile_codecs", {"LOWBIT_COMPILE_CODECS": "perhaps"}),
    ("topology", {"LOWBIT_TOPOLOGY": "ring"}),
    ("ranks_per_node", {"LOWBIT_RANKS_PER_NODE": "2.5"}),
    ("algorithm", {"LOWBIT_ALGORITHM": "adam"}),
    ("colour", {"LOWBIT_COLOUR": "red"}),
    ("bitdp.reduction", {"LOWBIT_BITDP_REDUCTION": "max"}),
    ("turboquant.block", {"LOWBIT_TURBOQUANT_BLOCK": "1000"}),
    ("lion.momentum_sync_every", {"LOWBIT_LION_MOMENTUM_SYNC_EVERY": "1.5"}),
]


def _params():
    return [nn.Parameter(torch.zeros(3))]


#: (exception type, what the message names, a call that must raise)
OPTIMIZERS_AND_LAYERS = [
    *[(ValueError, "lr", lambda v=v: Lion(_params(), lr=v)) for v in (NAN, INF, -1e-3, True, "1e-3", None)],
    *[(ValueError, "weight_decay", lambda v=v: Lion(_params(), weight_decay=v)) for v in (INF, NAN, -0.1)],
    *[(ValueError, "betas", lambda v=v: Lion(_params(), betas=v)) for v in ((NAN, 0.99), (0.9, 1.0), (0.9,), 0.9)],
    *[(ValueError, name, lambda cls=cls, name=name, v=v: cls(_params(), **{name: v}))
      for cls in (OneBitAdam, OneBitLamb, TurboQuantAdamW)
      for name, v in (("lr", INF), ("lr", NAN), ("weight_decay", INF), ("eps", INF), ("eps", 0.0))],
    *[(ValueError, "freeze_step", lambda v=v: OneBitAdam(_params(), freeze_step=v)) for v in (0, 1.5, True)],
    *[(ValueError, name, lambda name=name, v=v: OneBitLamb(_params(), **{name: v}))
      for name, v in (("max_coeff", INF), ("min_coeff", 0.0), ("coeff_beta", 1.0), ("factor_max", NAN),
                      ("factor_threshold", -0.1))],
    *[(ValueError, "bits", lambda v=v: TurboQuantAdamW(_params(), bits=v)) for v in (1, 9, 4.0)],
    (ValueError, "variance", lambda: TurboQuantAdamW(_params(), variance="global")),
    (ValueError, "scale_decay", lambda: TurboQuantAdamW(_params(), scale_decay=INF)),
    *[(ValueError, "in_features", lambda v=v: TurboQuantLinear(v, 4)) for v in (0, -1, 2.0)],
    (ValueError, "out_features", lambda: TurboQuantLinear(4, 0)),
    *[(ValueError, "seed", lambda v=v: TurboQuantLinear(4, 4, seed=v)) for v in (-1, 2**70)],
    *[(ValueError, "bits", lambda v=v: TurboQuantLinear(4, 4, bits=v)) for v in (1, 9)],
    (ValueError, "block", lambda: TurboQuantLinear(4, 4, block=3)),
    # checked before looking for layers: a model with no linear layer still says so
    (ValueError, "bits", lambda: compress_activations(nn.ReLU(), bits=9)),
    (ValueError, "block", lambda: compress_activations(nn.ReLU(), block=3)),
    (ValueError, "seed", lambda: compress_activations(nn.ReLU(), seed=-1)),
]


def test_the_table_holds_at_least_a_hundred_bad_inputs():
    assert len(CONFIG) + len(YAML) + len(ENV) + len(OPTIMIZERS_AND_LAYERS) + len(CALLBACKS) >= 100


@pytest.mark.parametrize("field, kwargs", CONFIG, ids=[f"{f}={list(k.values())[-1]!r}"[:60] for f, k in CONFIG])
def test_config_keyword_arguments(field, kwargs):
    with pytest.raises(ConfigError) as caught:
        LowBitConfig(**kwargs)
    message = str(caught.value)
    assert f"LowBitConfig.{field}" in message or f"{field}" in message, message
    assert len(message) < 1000, message  # values are shown shortened


@pytest.mark.parametrize("field, text", YAML, ids=[f for f, _ in YAML])
def test_yaml_files(tmp_path, field, text):
    path = tmp_path / "lowbit.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as caught:
        LowBitConfig.from_yaml(path)
    message = str(caught.value)
    assert field in message and len(message) < 1000, message


@pytest.mark.parametrize("field, env", ENV, ids=[f for f, _ in ENV])
def test_environment(field, env):
    with pytest.raises(ConfigError) as caught:
        LowBitConfig.from_env(env)
    assert field in str(caught.value), str(caught.value)


@pytest.mark.parametrize("error, field, call", OPTIMIZERS_AND_LAYERS, ids=[f for _, f, _ in OPTIMIZERS_AND_LAYERS])
def test_optimizers_and_layers(error, field, call):
    with pytest.raises(error) as caught:
        call()
    assert field in str(caught.value), str(caught.value)


def _callbacks():
    from callbacks import ActivationCompression, DivergenceMonitor, MomentumSync

    return [
        (ValueError, "block", lambda: ActivationCompression(block=3)),  # at construction, not at setup
        (ValueError, "bits", lambda: ActivationCompression(bits=1)),
        (ValueError, "every", lambda: DivergenceMonitor(every=0)),
        (ValueError, "every", lambda: MomentumSync(every=1.5)),
    ]


CALLBACKS = [None] * 4  # (counted in the table; built lazily: importing callbacks imports Lightning)


@pytest.mark.parametrize("index", range(len(CALLBACKS)))
def test_callbacks(index):
    error, field, call = _callbacks()[index]
    with pytest.raises(error) as caught:
        call()
    assert field in str(caught.value), str(caught.value)


def test_a_huge_value_is_shown_shortened():
    nested = [[[list(range(10**4))] * 50] * 50]
    with pytest.raises(ConfigError) as caught:
        LowBitConfig(bucket_size_mb=nested)
    assert len(str(caught.value)) < 400
