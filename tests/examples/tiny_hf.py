"""Transformers for the tests of the Hugging Face path, and a tiny model to run them on.

:func:`use_transformers` makes ``transformers`` importable: from the environment when it is
installed there (``pip install "lowbit-strategy[hf]"``), otherwise from ``<venv>/hf-overlay``,
where the Makefile installs it so that it stays off the path of every other test process
(torchmetrics imports it with each ``import lightning`` when it is installed).

:func:`write_tiny_gpt2` writes a tiny causal LM to a local directory, as a user's downloaded
model would be: GPT-2 architecture (Conv1D layers, tied head) with random weights, and a
byte-level BPE tokenizer trained on the reference-manual text. Offline, about a second.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

OVERLAY = Path(sys.prefix) / "hf-overlay"


def use_transformers() -> str | None:
    """Makes transformers importable here; returns the path a child process must append to
    its ``sys.path`` for it (None when it is installed in the environment itself). Skips the
    test when neither has it."""
    spec = importlib.util.find_spec("transformers") if str(OVERLAY) not in sys.path else None
    # (found in sys.modules after an earlier test imported it from the overlay, which
    # tests/conftest.py has taken off sys.path again since: still the overlay's)
    if spec is not None and not str(spec.origin or "").startswith(str(OVERLAY)):
        return None
    if not (OVERLAY / "transformers").is_dir():  # an environment not made by the Makefile (CI's is)
        import pytest

        pytest.skip(f"the Hugging Face tests need transformers: `make venv` installs it in {OVERLAY}, "
                    'or pip install "lowbit-strategy[hf]"')
    if str(OVERLAY) not in sys.path:
        sys.path.append(str(OVERLAY))  # after the environment's own packages: theirs win
        importlib.invalidate_caches()
    return str(OVERLAY)


def write_tiny_gpt2(path: Path, vocab: int = 320, context: int = 64, seed: int = 0) -> Path:
    use_transformers()
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    from examples.causal_lm import reference_manual_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([reference_manual_text()[:100_000]], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))  # GPT-2's end-of-text token, id 0 (TRL's SFTTrainer appends it to each text)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=context, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(path)
    return Path(path)
