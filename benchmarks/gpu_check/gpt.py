"""A GPT-2-shaped model in plain torch for part 4 (no download, no transformers, no Lightning:
``examples.gpt_lion.GPT`` is a LightningModule with a byte vocabulary, so its import and its
shape are not GPT-2's). GPT-2's parameters exactly: token and position embeddings, pre-norm
blocks with a fused qkv projection and biases, a 4x MLP, a final LayerNorm, and the output
head tied to the token embedding (124,439,808 parameters at the small size)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """``GPT(vocab, context, d, layers, heads)``; ``forward(idx)`` returns the logits."""

    def __init__(self, vocab: int = 50257, context: int = 1024, d: int = 768, layers: int = 12, heads: int = 12):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h))


#: GPT-2 small, and the tiny model of ``--cpu``
SMALL = {"vocab": 50257, "context": 1024, "d": 768, "layers": 12, "heads": 12}
TINY = {"vocab": 1024, "context": 128, "d": 128, "layers": 2, "heads": 4}
