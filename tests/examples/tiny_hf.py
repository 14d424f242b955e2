"""A tiny Hugging Face causal LM written to a local directory, as a user's downloaded model
would be: GPT-2 architecture (Conv1D layers, tied head) with random weights, and a byte-level
BPE tokenizer trained on the reference-manual text. Built offline in about a second."""
from __future__ import annotations

from pathlib import Path


def write_tiny_gpt2(path: Path, vocab: int = 320, context: int = 64, seed: int = 0) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from examples.causal_lm import reference_manual_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([reference_manual_text()[:100_000]], trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=context, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(path)
    return Path(path)
