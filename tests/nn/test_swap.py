"""compress_activations: exactly the selected layers, the same parameters, the same
state dict; decompress_activations undoes it."""
import copy

import pytest
import torch
from torch import nn

from lowbit_strategy.nn import TurboQuantLinear, compress_activations, decompress_activations


class TinyGPT(nn.Module):
    def __init__(self, vocab=32, d=64):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict({"qkv": nn.Linear(d, 3 * d), "fc": nn.Linear(d, 4 * d), "out": nn.Linear(4 * d, d)})
            for _ in range(2))
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)  # out_proj: a Linear subclass
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        h = self.wte(idx)
        for b in self.blocks:
            q = b["qkv"](h)[..., : h.shape[-1]]
            h = h + q + b["out"](torch.nn.functional.gelu(b["fc"](h)))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(h)


def _types(model):
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_default_swaps_every_plain_linear_but_the_head():
    model = TinyGPT()
    params = list(model.parameters())
    keys = list(model.state_dict())
    swapped = compress_activations(model)
    assert swapped == [f"blocks.{i}.{k}" for i in range(2) for k in ("qkv", "fc", "out")]
    types = _types(model)
    assert types["head"] == "Linear" and types["attn.out_proj"] == "NonDynamicallyQuantizableLinear"
    assert all(types[n] == "TurboQuantLinear" for n in swapped)
    assert all(p is q for p, q in zip(model.parameters(), params)) and len(list(model.parameters())) == len(params)
    assert list(model.state_dict()) == keys
    assert model.head.weight is model.wte.weight
    assert compress_activations(model) == []  # idempotent


def test_include_and_exclude_patterns():
    model = TinyGPT()
    assert compress_activations(model, include=["blocks.*.fc", "head"], exclude="blocks.1.*") == ["blocks.0.fc", "head"]
    assert set(n for n, t in _types(model).items() if t == "TurboQuantLinear") == {"blocks.0.fc", "head"}
    with pytest.raises(ValueError, match="include pattern 'blocks.\\*.mlp' matches no nn.Linear module name"):
        compress_activations(TinyGPT(), include="blocks.*.mlp")
    with pytest.raises(ValueError, match="exclude pattern 'nope'"):
        compress_activations(TinyGPT(), exclude=["nope"])
    with pytest.raises(ValueError, match="include: got \\[\\]"):
        compress_activations(TinyGPT(), include=[])


def test_shared_module_is_replaced_under_every_name():
    lin = nn.Linear(8, 8)
    model = nn.Sequential(lin, nn.ReLU(), lin, nn.Linear(8, 2))
    assert compress_activations(model) == ["0"]
    assert model[0] is model[2] and isinstance(model[0], TurboQuantLinear)


def test_outputs_and_state_dict_round_trip_with_and_without_the_swap():
    torch.manual_seed(0)
    plain = TinyGPT()
    comp = copy.deepcopy(plain)
    compress_activations(comp)
    idx = torch.randint(0, 32, (2, 5))
    assert torch.equal(plain(idx), comp(idx))
    # a state dict saved with the swap loads without it, and the other way round
    other = TinyGPT()
    other.load_state_dict(comp.state_dict())
    assert torch.equal(other(idx), plain(idx))
    comp2 = TinyGPT()
    compress_activations(comp2)
    comp2.load_state_dict(plain.state_dict())
    assert torch.equal(comp2(idx), plain(idx))
    # an optimizer's state follows the same parameters in the same order
    opt = torch.optim.AdamW(plain.parameters())
    plain(idx).sum().backward()
    opt.step()
    opt2 = torch.optim.AdamW(comp.parameters())
    opt2.load_state_dict(opt.state_dict())
    assert [tuple(s["exp_avg"].shape) for s in opt2.state.values()] == [tuple(p.shape) for p in comp.parameters()]


def test_decompress_restores_plain_linears_with_the_same_parameters():
    model = TinyGPT()
    w = model.blocks[0]["fc"].weight
    compress_activations(model)
    assert decompress_activations(model) == [f"blocks.{i}.{k}" for i in range(2) for k in ("qkv", "fc", "out")]
    assert type(model.blocks[0]["fc"]) is nn.Linear and model.blocks[0]["fc"].weight is w


def test_ddp_like_wrapper_is_looked_through():
    class Wrapper(nn.Module):
        def __init__(self, m):
            super().__init__()
            self._orig_mod = m  # what torch.compile's wrapper holds

    model = TinyGPT()
    assert len(compress_activations(Wrapper(model))) == 6
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        compress_activations("model")
