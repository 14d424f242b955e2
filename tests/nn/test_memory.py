"""SavedTensorMeter: the linear inputs' saved bytes fall by >= 6x for fp32, and the
'without compression' total it derives equals the total measured on the plain model."""
import copy

import pytest
import torch
from torch import nn

from lowbit_strategy.nn import SavedTensorMeter, compress_activations


def _mlp(d=256, layers=3):
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d)]
    return nn.Sequential(*mods, nn.Linear(d, 10))


def _measure(model, x):
    with SavedTensorMeter(model) as meter:
        loss = model(x).square().mean()
    loss.backward()
    return meter.stats


def test_linear_inputs_fall_by_at_least_6x_for_fp32_and_the_derived_total_is_exact():
    torch.manual_seed(0)
    plain = _mlp()
    comp = copy.deepcopy(plain)
    names = compress_activations(comp)
    assert len(names) == 6
    x = torch.randn(4, 64, 256)
    base, st = _measure(plain, x), _measure(comp, x)
    assert base.compressed_inputs == 0 and base.total_bytes_uncompressed == base.total_bytes
    assert st.compressed_inputs == 6
    # the counterfactual from the compressed pass is what the plain pass really kept
    assert st.total_bytes_uncompressed == base.total_bytes
    assert st.linear_input_bytes_uncompressed == base.linear_input_bytes
    # linear inputs without the head (which stays exact): >= 6x smaller
    head = 4 * 64 * 256 * 4
    ratio = (base.linear_input_bytes - head) / (st.linear_input_bytes - head)
    assert ratio >= 6.0, ratio
    assert st.saved_bytes > 0 and st.total_bytes < base.total_bytes


def test_meter_counts_a_storage_once_and_leaves_parameters_out():
    lin = nn.Linear(32, 32)
    x = torch.randn(8, 32)  # no grad: only the input is kept, once though read three times
    with SavedTensorMeter(lin) as meter:
        out = lin(x) + lin(x) + lin(x)
    assert meter.stats.total_bytes == 8 * 32 * 4 == meter.stats.linear_input_bytes
    out.sum().backward()


def test_bf16_inputs_are_counted_at_their_own_width():
    torch.manual_seed(0)
    plain = _mlp(layers=1).to(torch.bfloat16)
    comp = copy.deepcopy(plain)
    compress_activations(comp)
    x = torch.randn(2, 64, 256, dtype=torch.bfloat16)
    base, st = _measure(plain, x), _measure(comp, x)
    assert st.total_bytes_uncompressed == base.total_bytes
    head = 2 * 64 * 256 * 2
    assert (base.linear_input_bytes - head) / (st.linear_input_bytes - head) >= 3.0  # 16 -> ~4.5 bits


def test_start_stop_misuse_is_a_clear_error():
    meter = SavedTensorMeter()
    with pytest.raises(RuntimeError, match="not started; call start\\(\\) first"):
        meter.stop()
    meter.start()
    with pytest.raises(RuntimeError, match="already started"):
        meter.start()
    meter.stop()
    with pytest.raises(TypeError, match="model must be an nn.Module or None"):
        SavedTensorMeter(model=3)
