"""Causal language models for the examples: one LightningModule base, the text they read.

:class:`CausalLM` holds what every example model shares: the next-token loss, its logging,
the optimizer each low-bit algorithm drives (Lion, AdamW, 1-bit Adam/LAMB,
TurboQuantAdamW) with a linear warm-up + cosine schedule, and sampling. The byte-level GPT
of ``gpt_lion.py`` builds on it, and so does :class:`HFCausalLM`, a pretrained Hugging Face
model read from a local directory (``pip install "lowbit-strategy[hf]"``), which is how
``finetune.ipynb`` fine-tunes a model you already have.

Text, all of it installed with Python (offline): the standard library's source code
(``gpt_lion.stdlib_bytes``, what the GPT is pretrained on) and :func:`reference_manual_text`,
English prose of the Python Language Reference, the "new text" the notebook fine-tunes on.
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.nn import functional as F
from torch.utils.data import Dataset

import lowbit_strategy

OPTIMIZERS = ("lion", "adamw", "onebit_adam", "onebit_lamb", "turboquant", "demo")
#: the hyperparameters a fine-tuning run may change (the rest describe the model's shape)
TRAINING_HPARAMS = ("optimizer", "lr", "weight_decay", "warmup", "total_steps", "freeze_step", "variance",
                    "scale_decay", "update_clip", "guard", "demo_topk")


# ---- text -----------------------------------------------------------------------------
def reference_manual_text() -> str:
    """The Python Language Reference's topics (``pydoc_data.topics``, what ``help()`` shows),
    in sorted topic order: about 0.45 MB of English prose with a little code. None of it is
    in what :func:`gpt_lion.stdlib_bytes` reads by default, so it is new text to the GPT."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256), the GPT's tokenizer; the same two methods as a
    Hugging Face tokenizer's, so that the notebook treats both alike."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class Windows(Dataset):
    """Non-overlapping windows of ``seq + 1`` tokens: (input, next-token target)."""

    def __init__(self, tokens: torch.Tensor, seq: int):
        self.tokens, self.seq = tokens, seq

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq

    def __getitem__(self, i):
        w = self.tokens[i * self.seq: i * self.seq + self.seq + 1]
        return w[:-1], w[1:]


def split_windows(tokens: torch.Tensor, seq: int, held_out: float = 0.1) -> tuple[Windows, Windows]:
    """Training and validation windows: the last ``held_out`` of the tokens is validation."""
    cut = int(len(tokens) * (1 - held_out))
    return Windows(tokens[:cut], seq), Windows(tokens[cut:], seq)


# ---- models ---------------------------------------------------------------------------
class CausalLM(pl.LightningModule):
    """Next-token training for a model whose ``forward(ids)`` returns logits.

    Subclasses save these hyperparameters (``self.save_hyperparameters()``): ``optimizer``
    (one of :data:`OPTIMIZERS`), ``lr``, ``weight_decay``, ``warmup``, ``total_steps``, and
    for the staged optimizers ``freeze_step`` (None: 20 % of ``total_steps``), ``variance``
    and ``scale_decay``; and they set :attr:`context`, the longest input they take.
    """

    context: int = 0

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        hp = self.hparams
        opt = make_optimizer(self.parameters(), hp)

        def schedule(step):  # linear warm-up, cosine decay to 10 %
            if step < hp.warmup:
                return (step + 1) / hp.warmup
            frac = min(1.0, (step - hp.warmup) / max(1, hp.total_steps - hp.warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def with_hparams(self, **changes) -> "CausalLM":
        """A deep copy with some training hyperparameters changed (:data:`TRAINING_HPARAMS`:
        the optimizer, ``lr``, the schedule's ``total_steps``, ...): how one pretrained model
        starts several fine-tuning runs. Loggers record the changed values."""
        unknown = set(changes) - (set(TRAINING_HPARAMS) & set(self.hparams))
        if unknown:
            raise ValueError(f"with_hparams: {sorted(unknown)} cannot be changed on a built model; "
                             f"change one of {sorted(set(TRAINING_HPARAMS) & set(self.hparams))}")
        if "optimizer" in changes and changes["optimizer"] not in OPTIMIZERS:
            raise ValueError(f"with_hparams: optimizer={changes['optimizer']!r}; use one of {OPTIMIZERS}")
        twin = copy.deepcopy(self)
        twin.hparams.update(changes)
        twin._hparams_initial = copy.deepcopy(twin._hparams)  # what loggers write (hparams.yaml)
        return twin

    @torch.no_grad()
    def generate(self, ids: list[int], new_tokens: int = 100, temperature: float = 0.8, top_k: int = 40,
                 seed: int = 0) -> list[int]:
        """``ids`` followed by ``new_tokens`` sampled ones: softmax of ``logits / temperature``
        over the ``top_k`` likeliest tokens, from a generator seeded with ``seed`` (the same
        call gives the same text). The model is evaluated in eval mode and left as it was."""
        if not ids:
            raise ValueError("generate: ids is empty; give at least one prompt token")
        was_training = self.training
        self.eval()
        gen = torch.Generator().manual_seed(seed)
        out = torch.tensor([ids], dtype=torch.long, device=self.device)
        for _ in range(new_tokens):
            logits = self(out[:, -self.context:])[0, -1].float().cpu() / max(temperature, 1e-6)
            top = torch.topk(logits, min(top_k, logits.numel()))
            choice = torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)
            out = torch.cat([out, top.indices[choice].view(1, 1).to(out.device)], dim=1)
        self.train(was_training)
        return out[0].tolist()


def make_optimizer(params, hp) -> torch.optim.Optimizer:
    """The optimizer named by ``hp.optimizer``, the one the chosen strategy drives: Lion for
    ``lowbit_lion*``, any (AdamW here) for ``lowbit_bitdp*`` and plain DDP, OneBitAdam /
    OneBitLamb for ``lowbit_adam`` / ``lowbit_lamb``, TurboQuantAdamW for ``lowbit_turboquant``,
    DeMo for ``lowbit_demo``."""
    freeze = getattr(hp, "freeze_step", None) or max(1, hp.total_steps // 5)
    if hp.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay)
    if hp.optimizer in ("onebit_adam", "onebit_lamb"):  # full-precision warm-up, then 1-bit momenta
        cls = lowbit_strategy.OneBitAdam if hp.optimizer == "onebit_adam" else lowbit_strategy.OneBitLamb
        return cls(params, lr=hp.lr, weight_decay=hp.weight_decay, freeze_step=freeze,
                   update_clip=getattr(hp, "update_clip", "auto"), guard=getattr(hp, "guard", 1000.0))
    if hp.optimizer == "turboquant":  # full-precision warm-up, then 4-bit momenta
        return lowbit_strategy.TurboQuantAdamW(params, lr=hp.lr, weight_decay=hp.weight_decay, warmup_steps=freeze,
                                               variance=getattr(hp, "variance", "synchronized"),
                                               scale_decay=getattr(hp, "scale_decay", 0.0))
    if hp.optimizer == "lion":
        return lowbit_strategy.Lion(params, lr=hp.lr, betas=(0.9, 0.99), weight_decay=hp.weight_decay)
    if hp.optimizer == "demo":  # sign steps of the workers' mean top-k DCT components of momentum
        return lowbit_strategy.DeMo(params, lr=hp.lr, weight_decay=hp.weight_decay,
                                    compression_topk=getattr(hp, "demo_topk", 32))
    raise ValueError(f"optimizer={hp.optimizer!r}; use one of {OPTIMIZERS}")


class HFCausalLM(CausalLM):
    """A pretrained Hugging Face causal LM (GPT-2, Llama, Qwen, ...) from a local directory,
    trained like the GPT: ``HFCausalLM("/models/gpt2", optimizer="lion", lr=1e-4)``.

    Reads weights and tokenizer with ``local_files_only=True`` (nothing is downloaded), in
    float32 (mixed precision is the Trainer's ``precision=`` choice). :attr:`tokenizer` is the
    model's own; :attr:`context` its position limit (at most ``max_context``)."""

    def __init__(self, path: str, optimizer: str = "lion", lr: float = 1e-4, weight_decay: float = 0.0,
                 warmup: int = 10, total_steps: int = 100, freeze_step: int | None = None,
                 max_context: int = 1024):
        super().__init__()
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"HFCausalLM: optimizer={optimizer!r}; use one of {OPTIMIZERS}")
        try:
            from transformers import AutoModelForCausalLM, AutoTokenizer
        except ImportError as err:  # the optional extra
            raise ImportError('HFCausalLM needs transformers: pip install "lowbit-strategy[hf]"') from err
        if not Path(path).is_dir():
            raise FileNotFoundError(f"HFCausalLM: path={path!r} is not a directory; give the local directory "
                                    "of a Hugging Face model (its config.json, weights and tokenizer files)")
        self.save_hyperparameters()
        # from_pretrained returns eval mode; Lightning keeps modules in the mode it finds them,
        # so switch to train mode here (dropout on), as the Hugging Face Trainer does
        self.net = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).float().train()
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        limit = getattr(self.net.config, "max_position_embeddings", None) or getattr(self.net.config, "n_positions", 0)
        self.context = min(max_context, limit or max_context)

    def forward(self, ids):
        return self.net(input_ids=ids, use_cache=False).logits  # no key/value cache: training, and
        # generate() feeds the whole window each time
