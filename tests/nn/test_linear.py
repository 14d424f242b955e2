"""TurboQuantLinear against nn.Linear: exact forward and input gradient, the weight
gradient from the decoded input within the codec's error, nothing kept without grad."""
import math

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lowbit_strategy.codecs import lloyd_max_codebook, lloyd_max_mse
from lowbit_strategy.nn import SavedTensorMeter, TurboQuantLinear, default_block
from lowbit_strategy.nn.linear import shared_codec


def _pair(in_f=192, out_f=48, bias=True, seed=0, **kw):
    torch.manual_seed(seed)
    lin = nn.Linear(in_f, out_f, bias=bias)
    return lin, TurboQuantLinear.from_linear(lin, **kw)


def _grads(module, x, g, autocast=False):
    x = x.detach().clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = module(x)
    out.backward(g.to(out.dtype))
    return out.detach(), x.grad, module.weight.grad.clone(), None if module.bias is None else module.bias.grad.clone()


@pytest.mark.parametrize("shape", [(192,), (7, 192), (2, 5, 192), (2, 3, 4, 192)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_input_and_bias_gradients_are_nn_linears(shape, bias):
    lin, tq = _pair(bias=bias)
    x = torch.randn(shape)
    g = torch.randn(*shape[:-1], 48)
    out_l, gx_l, _, gb_l = _grads(lin, x, g)
    out_t, gx_t, _, gb_t = _grads(tq, x, g)
    assert torch.equal(out_l, out_t)
    assert torch.equal(gx_l, gx_t)
    if bias:
        assert torch.equal(gb_l, gb_t)


def test_bf16_autocast_matches_nn_linear_in_values_and_dtypes():
    lin, tq = _pair(in_f=256, out_f=64)
    x, g = torch.randn(4, 16, 256), torch.randn(4, 16, 64)
    out_l, gx_l, gw_l, gb_l = _grads(lin, x, g, autocast=True)
    out_t, gx_t, gw_t, gb_t = _grads(tq, x, g, autocast=True)
    assert out_t.dtype == out_l.dtype == torch.bfloat16 and torch.equal(out_l, out_t)
    assert gx_t.dtype == torch.float32 and torch.equal(gx_l, gx_t)
    assert gw_t.dtype == lin.weight.dtype == torch.float32 and torch.equal(gb_l, gb_t)
    rel = ((gw_t - gw_l).norm() / gw_l.norm()).item()
    assert 0 < rel < 1.5 * math.sqrt(lloyd_max_mse(lloyd_max_codebook(4)))  # bf16 rounding on top of the codes


def test_bf16_parameters_and_inputs():
    lin, _ = _pair()
    lin = lin.to(torch.bfloat16)
    tq = TurboQuantLinear.from_linear(lin)
    x, g = torch.randn(3, 10, 192, dtype=torch.bfloat16), torch.randn(3, 10, 48, dtype=torch.bfloat16)
    out_l, gx_l, gw_l, _ = _grads(lin, x, g)
    out_t, gx_t, gw_t, _ = _grads(tq, x, g)
    assert torch.equal(out_l, out_t) and torch.equal(gx_l, gx_t) and gw_t.dtype == torch.bfloat16


@pytest.mark.parametrize("bits", [2, 4])
def test_weight_gradient_is_from_the_decoded_input_within_the_codec_error(bits):
    lin, tq = _pair(in_f=256, out_f=64, bits=bits)
    x, g = torch.randn(8, 32, 256), torch.randn(8, 32, 64)
    _, _, gw_exact, _ = _grads(lin, x, g)
    _, _, gw, _ = _grads(tq, x, g)
    x_hat = shared_codec(bits, tq.block, 0).roundtrip(x)
    g2, x2, xh2 = g.reshape(-1, 64), x.reshape(-1, 256), x_hat.reshape(-1, 256)
    torch.testing.assert_close(gw, g2.t() @ xh2, rtol=1e-4, atol=1e-4)
    # the codec's error bound: ||x̂ - x||² ≈ D·||x||² for a Gaussian input, D the codebook's MSE
    d = lloyd_max_mse(lloyd_max_codebook(bits))
    err = (xh2 - x2).norm()
    assert err <= 1.25 * math.sqrt(d) * x2.norm()
    # and the gradient error is gᵀ(x̂ - x): at most ||g||₂·||x̂ - x||
    assert (gw - gw_exact).norm() <= torch.linalg.matrix_norm(g2, ord=2) * err * (1 + 1e-4)
    assert not torch.allclose(gw, gw_exact)  # it really is from the codes


def test_blocks_stay_inside_a_token_so_an_outlier_token_does_not_coarsen_the_others():
    assert [default_block(n) for n in (192, 768, 4096, 64, 100, 32, 3)] == [64, 256, 1024, 64, 1024, 1024, 1024]
    _, tq = _pair(in_f=192)
    x = torch.randn(16, 192)
    y = x.clone()
    y[0] *= 1000.0
    a, b = tq.codec.roundtrip(x), tq.codec.roundtrip(y)
    assert torch.equal(a[1:], b[1:])
    _, flat = _pair(in_f=192, block=1024)  # blocks across tokens: the outlier's scale spreads
    assert not torch.equal(flat.codec.roundtrip(x)[1:], flat.codec.roundtrip(y)[1:])


def test_two_calls_before_backward_keep_their_own_codes():
    lin, tq = _pair(in_f=128, out_f=32)
    x1, x2 = torch.randn(5, 128), torch.randn(5, 128)
    (tq(x1).sum() + 2 * tq(x2).sum()).backward()
    c = tq.codec
    ones = torch.ones(5, 32)
    expected = ones.t() @ c.roundtrip(x1) + (2 * ones).t() @ c.roundtrip(x2)
    torch.testing.assert_close(tq.weight.grad, expected, rtol=1e-5, atol=1e-5)
    assert not any(isinstance(v, torch.Tensor) for k, v in vars(tq).items() if not k.startswith("_"))


def test_activation_checkpointing_recomputes_and_gives_the_same_gradient():
    _, tq = _pair(in_f=128, out_f=32)
    x = torch.randn(6, 128)
    tq(x).square().sum().backward()
    plain = tq.weight.grad.clone()
    tq.zero_grad(set_to_none=True)
    checkpoint(lambda t: tq(t).square(), x, use_reentrant=False).sum().backward()
    torch.testing.assert_close(tq.weight.grad, plain)


def test_keeps_nothing_without_grad_and_no_input_for_a_frozen_weight():
    lin, tq = _pair(in_f=128, out_f=32)
    x = torch.randn(4, 128)
    with SavedTensorMeter(tq) as meter, torch.no_grad():
        out = tq(x)
    assert out.grad_fn is None and meter.stats.total_bytes == 0 and meter.stats.compressed_inputs == 0
    tq.requires_grad_(False)
    with SavedTensorMeter(tq) as meter:
        out = tq(x)
    assert out.grad_fn is None and meter.stats.total_bytes == 0
    xg = x.clone().requires_grad_(True)
    with SavedTensorMeter(tq) as meter:
        out = tq(xg)  # the input gradient needs only the (excluded) weight
    assert meter.stats.compressed_inputs == 0 and meter.stats.total_bytes == 0
    out.sum().backward()
    torch.testing.assert_close(xg.grad, torch.ones(4, 32) @ tq.weight)


def test_state_dict_keys_and_round_trip_with_nn_linear():
    lin, tq = _pair()
    assert tq.weight is lin.weight and tq.bias is lin.bias
    assert list(tq.state_dict()) == list(lin.state_dict()) == ["weight", "bias"]
    fresh = TurboQuantLinear(192, 48)
    fresh.load_state_dict(lin.state_dict())
    back = nn.Linear(192, 48)
    back.load_state_dict(fresh.state_dict())
    assert torch.equal(back.weight, lin.weight) and torch.equal(back.bias, lin.bias)
    plain = tq.to_linear()
    assert type(plain) is nn.Linear and plain.weight is lin.weight


def test_from_linear_keeps_hooks_and_training_flag():
    lin = nn.Linear(64, 8)
    seen = []
    lin.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    lin.eval()
    tq = TurboQuantLinear.from_linear(lin)
    tq(torch.randn(2, 64))
    assert seen == [torch.Size([2, 8])] and not tq.training
    tq.register_forward_hook(lambda m, i, o: seen.append("tq only"))
    lin(torch.randn(2, 64))
    assert seen[-1] == torch.Size([2, 8])  # containers were copied: the new hook is tq's alone


def test_errors_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match="bits must be an int in \\[2, 8\\]"):
        TurboQuantLinear(8, 8, bits=1)
    with pytest.raises(ValueError, match="block must be a power of two.*block=None"):
        TurboQuantLinear(8, 8, block=48)
    with pytest.raises(TypeError, match="must be a torch.nn.Linear \\(not a subclass"):
        TurboQuantLinear.from_linear(nn.MultiheadAttention(8, 2).out_proj)
    assert TurboQuantLinear(8, 8).extra_repr().endswith("bits=4, block=1024")
