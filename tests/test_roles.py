"""The shared parameter roles and the one pattern rule (lowbit_strategy.roles)."""
import pytest
from torch import nn

from lowbit_strategy.roles import input_output_params, output_embedding, output_head, param_names, select_params


class GPTLike(nn.Module):
    def __init__(self, tied=True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(50, 8), nn.Embedding(16, 8)
        self.block = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8))
        self.ln_f = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 50, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight


def test_auto_picks_input_embedding_and_output_head_once_when_tied():
    tied = GPTLike(tied=True)
    assert [id(p) for p in input_output_params(tied)] == [id(tied.wte.weight)]
    untied = GPTLike(tied=False)
    assert [id(p) for p in select_params(untied, "auto")] == [id(untied.wte.weight), id(untied.lm_head.weight)]


def test_auto_without_embedding_uses_first_and_last_parameterized_modules():
    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    got = {id(p) for p in select_params(mlp, "auto")}
    assert got == {id(p) for m in (mlp[0], mlp[2]) for p in m.parameters()}


def test_all_none_and_patterns():
    m = GPTLike()
    assert len(select_params(m, "all")) == len(list(m.parameters()))
    assert select_params(m, "none") == []
    got = select_params(m, ("block.*", "ln_f.weight"))
    assert {id(p) for p in got} == {id(p) for p in m.block.parameters()} | {id(m.ln_f.weight)}
    with pytest.raises(ValueError, match=r"^layers: pattern 'blocks\.\*' matches no parameter name \(names look "
                                         r"like: wte\.weight, wpe\.weight"):
        select_params(m, ["block.*", "blocks.*"])


def test_param_names_first_name_of_tied_weight():
    m = GPTLike()
    assert param_names(m)[id(m.wte.weight)] == "wte.weight"
