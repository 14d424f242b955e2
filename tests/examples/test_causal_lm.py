"""examples/causal_lm.py: the model base the GPT example and the notebook share, the text it
reads, the GPT's weights file (what ``make demo`` writes) and a local Hugging Face model."""
import json
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import lowbit_strategy
from examples.causal_lm import ByteTokenizer, HFCausalLM, reference_manual_text, split_windows
from examples.gpt_lion import GPT, stdlib_bytes
from tests.examples.tiny_hf import use_transformers, write_tiny_gpt2

ROOT = Path(__file__).resolve().parents[2]


def tiny_gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(seq=16, d=32, layers=1, heads=2, **kw)


def test_byte_tokenizer_round_trips_any_text():
    tok = ByteTokenizer()
    text = "The “assert” statement — naïve café\n\tend"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < tok.vocab_size == 256
    assert tok.decode([0xE2, 0x80]) == "\ufffd"  # a cut multi-byte character decodes, replaced


def test_reference_manual_is_prose_the_pretraining_text_does_not_hold():
    text = reference_manual_text()
    assert len(text) > 300_000 and "assert statement" in text
    assert text[:2000].encode() not in bytes(stdlib_bytes().to(torch.uint8).tolist())  # the default 6 MB


def test_split_windows_holds_out_the_tail_as_next_token_pairs():
    tokens = torch.arange(1001)
    train, val = split_windows(tokens, seq=10)
    x, y = train[3]
    assert torch.equal(x, torch.arange(30, 40)) and torch.equal(y, torch.arange(31, 41))
    assert len(train) == 89 and int(val[0][0][0]) == 900 and len(val) == 10


def test_generate_is_seeded_keeps_the_prompt_and_leaves_the_mode():
    model = tiny_gpt()
    model.train()
    prompt = ByteTokenizer().encode("def f")
    a, b = model.generate(prompt, 40, seed=1), model.generate(prompt, 40, seed=1)
    assert a == b and a[:5] == prompt and len(a) == 45 and model.training
    assert model.generate(prompt, 40, seed=2) != a
    # beyond the context the model sees the last `context` tokens only: no position overflow
    assert len(model.generate(prompt, 30, seed=0)) == 35 > model.context
    greedy = model.generate(prompt, 1, top_k=1)[-1]
    assert greedy == int(model(torch.tensor([prompt]))[0, -1].argmax())
    with pytest.raises(ValueError, match="ids is empty"):
        model.generate([], 3)


def test_with_hparams_copies_with_a_new_optimizer_and_rejects_unknown_fields():
    model = tiny_gpt(optimizer="adamw", lr=3e-3)
    twin = model.with_hparams(optimizer="lion", lr=1e-4, total_steps=10)
    assert (twin.hparams.optimizer, twin.hparams.lr, model.hparams.optimizer) == ("lion", 1e-4, "adamw")
    assert all(torch.equal(p, q) and p is not q for p, q in zip(model.parameters(), twin.parameters()))
    opt = twin.configure_optimizers()["optimizer"]
    assert isinstance(opt, lowbit_strategy.Lion) and opt.param_groups[0]["lr"] == pytest.approx(1e-4 / twin.hparams.warmup)
    with pytest.raises(ValueError, match=r"\['lrr'\] cannot be changed on a built model"):
        model.with_hparams(lrr=1.0)
    with pytest.raises(ValueError, match=r"\['d'\] cannot be changed"):
        model.with_hparams(d=64)  # a shape: the weights would not match it
    assert twin.hparams_initial.optimizer == "lion"  # what a logger writes to hparams.yaml
    with pytest.raises(ValueError, match="optimizer='sgd'; use one of"):
        model.with_hparams(optimizer="sgd")


@pytest.mark.parametrize("name, cls", [("onebit_adam", lowbit_strategy.OneBitAdam),
                                       ("turboquant", lowbit_strategy.TurboQuantAdamW),
                                       ("adamw", torch.optim.AdamW)])
def test_each_optimizer_name_builds_the_optimizer_its_strategy_drives(name, cls):
    assert type(tiny_gpt(optimizer=name).configure_optimizers()["optimizer"]) is cls


def test_gpt_weights_file_round_trips_with_changed_training_hparams(tmp_path):
    model = tiny_gpt(optimizer="adamw")
    with torch.no_grad():
        model.blocks[0].fc.weight.add_(1.0)  # not what a fresh model starts from
    model.save_weights(tmp_path / "sub" / "w.pt")
    loaded = GPT.load_weights(tmp_path / "sub" / "w.pt", optimizer="lion", lr=5e-4)
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(loaded(x), model(x))
    assert (loaded.hparams.optimizer, loaded.hparams.lr, loaded.hparams.d, loaded.context) == ("lion", 5e-4, 32, 16)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return write_tiny_gpt2(tmp_path_factory.mktemp("hf") / "tiny-gpt2")


def test_hf_model_from_a_local_directory_is_the_models_own_logits_and_tokenizer(tiny_hf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = HFCausalLM(str(tiny_hf), optimizer="adamw", lr=1e-3)
    reference = AutoModelForCausalLM.from_pretrained(tiny_hf, local_files_only=True)
    ids = model.tokenizer.encode("The assert statement")
    assert ids == AutoTokenizer.from_pretrained(tiny_hf).encode("The assert statement")
    assert model.tokenizer.decode(ids) == "The assert statement"
    assert model.net.training, "from_pretrained gives eval mode; fine-tuning wants dropout on"
    x = torch.tensor([ids])
    assert torch.equal(model.eval()(x), reference(input_ids=x).logits)
    assert model.context == 64 and len(model.generate(ids, 70, seed=0)) == len(ids) + 70


@pytest.mark.slow
def test_hf_model_fine_tunes_through_the_trainer(tiny_hf):
    model = HFCausalLM(str(tiny_hf), optimizer="lion", lr=3e-3, total_steps=30, warmup=1)
    tokens = torch.tensor(model.tokenizer.encode(reference_manual_text()[:60_000]))
    train, val = split_windows(tokens, seq=32)
    val_loader = DataLoader(val, batch_size=16)
    quiet = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                 enable_model_summary=False)
    first = pl.Trainer(**quiet).validate(model, val_loader, verbose=False)[0]["val_loss"]
    pl.Trainer(max_steps=30, limit_val_batches=0, **quiet).fit(model, DataLoader(train, batch_size=16, shuffle=True))
    last = pl.Trainer(**quiet).validate(model, val_loader, verbose=False)[0]["val_loss"]
    assert last < first - 0.5, (first, last)


def test_hf_model_errors_name_the_field_and_the_fix(tmp_path, monkeypatch):
    use_transformers()
    with pytest.raises(FileNotFoundError, match="path=.*is not a directory"):
        HFCausalLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="optimizer='sgd'"):
        HFCausalLM(str(tmp_path), optimizer="sgd")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r'pip install "lowbit-strategy\[hf\]"'):
        HFCausalLM(str(tmp_path))


@pytest.mark.slow
def test_gpt_example_writes_the_weights_the_notebook_loads(tmp_path):
    weights, out = tmp_path / "gpt_demo.pt", tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "examples/gpt_lion.py", "--devices", "2", "--max-steps", "6", "--data-mb", "0.3",
         "--d-model", "32", "--layers", "1", "--val-every", "3", "--val-batches", "2", "--save-weights",
         str(weights), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "weights saved to" in proc.stdout
    summary = json.loads(out.read_text())
    model = GPT.load_weights(weights)
    torch.manual_seed(0)  # the example seeds 0 before building its model: this is where the run began
    start = GPT(**model.hparams)
    with torch.no_grad():
        moved = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), start.parameters()))
    # 6 Lion steps in the 50-step linear warm-up of lr 1e-3 move a weight by at most
    # sum(lr_t) * (1 + weight_decay * |w|) = 1e-3 * (1 + ... + 6) / 50 * (1 + 0.1 * 1.0): the
    # largest weights are LayerNorm's 1.0
    assert summary["steps"] == 6 and summary["bytes_per_step"] > 0 and model.hparams.d == 32
    assert 1e-5 < moved <= 4.2e-4 * 1.1 + 1e-7, moved
