"""ActivationCompression: swaps exactly the selected layers at setup (before the optimizer
and the DDP wrapper exist), reports the saved bytes, and its checkpoints load without it
and the other way round."""
import json
import logging
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from callbacks import ActivationCompression
from lowbit_strategy.nn import TurboQuantLinear
from tests.lightning_app import VOCAB, TinyLM, loader, trainer

ROOT = Path(__file__).resolve().parents[2]


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 64)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64)) for _ in range(2))
        self.head = nn.Linear(64, VOCAB)

    def forward(self, x):
        h = self.wte(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _types(model):
    return {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_setup_swaps_exactly_the_selected_modules_and_logs_them(caplog):
    tr = trainer("auto", 1, 1)
    model = Net()
    params = list(model.parameters())
    cb = ActivationCompression(exclude="blocks.1.0")
    with caplog.at_level(logging.INFO, logger="callbacks.activation_compression"):
        cb.setup(tr, model, "fit")
    assert cb.swapped == ["blocks.0.0", "blocks.0.2", "blocks.1.2"]
    assert _types(model) == {"blocks.0.0": "TurboQuantLinear", "blocks.0.2": "TurboQuantLinear",
                             "blocks.1.0": "Linear", "blocks.1.2": "TurboQuantLinear", "head": "Linear"}
    assert all(p is q for p, q in zip(model.parameters(), params))
    assert "3 linear layers keep their input for backward as 4-bit codes" in caplog.text
    assert "left exact: blocks.1.0, head" in caplog.text
    cb.setup(tr, model, "validate")  # a second stage: nothing more to swap
    assert cb.swapped == ["blocks.0.0", "blocks.0.2", "blocks.1.2"]


def test_bad_arguments_are_refused_at_construction_or_setup():
    with pytest.raises(ValueError, match="ActivationCompression: bits must be an int in \\[2, 8\\]"):
        ActivationCompression(bits=16)
    with pytest.raises(ValueError, match="ActivationCompression: include: got"):
        ActivationCompression(include=[""])
    with pytest.raises(ValueError, match="include pattern 'blocks.\\*.fc' matches no nn.Linear"):
        ActivationCompression(include="blocks.*.fc").setup(trainer("auto", 1, 1), Net(), "fit")


@pytest.mark.slow
def test_one_device_fit_reports_savings_and_checkpoints_load_both_ways(tmp_path):
    pl.seed_everything(0, verbose=False)
    model = Net()
    cb = ActivationCompression()
    tr = trainer("auto", 1, 1, callbacks=[cb])
    tr.fit(model, loader())
    assert cb.swapped == ["blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2"]
    r = cb.report
    assert r.compressed_inputs == 4 and r.total_bytes < r.total_bytes_uncompressed
    head_input = 8 * 8 * 64 * 4  # batch 8 x seq 8 x 64 features, fp32: kept exact
    assert (r.linear_input_bytes_uncompressed - head_input) / (r.linear_input_bytes - head_input) >= 6.0
    ckpt = tmp_path / "with.ckpt"
    tr.save_checkpoint(ckpt)
    # with -> without: plain layers resume from it
    plain = Net()
    tr2 = trainer("auto", 1, 2)
    tr2.fit(plain, loader(), ckpt_path=ckpt)
    assert "TurboQuantLinear" not in _types(plain).values() and tr2.global_step == 16
    # without -> with: the callback's model resumes from a plain checkpoint
    tr2.save_checkpoint(tmp_path / "without.ckpt")
    again, cb2 = Net(), ActivationCompression(measure=False)
    tr3 = trainer("auto", 1, 3, callbacks=[cb2])
    tr3.fit(again, loader(), ckpt_path=tmp_path / "without.ckpt")
    assert tr3.global_step == 24 and cb2.report is None and isinstance(again.blocks[0][0], TurboQuantLinear)
    assert all(torch.isfinite(v).all() for v in again.state_dict().values())


@pytest.mark.slow
def test_two_processes_with_a_lowbit_strategy(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.callbacks.activation_app", "--strategy", "lowbit_lion", "--devices", "2",
         "--workdir", str(tmp_path), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0 and out.exists(), proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and r["swapped"] == ["mlp.0", "mlp.2"]
    assert r["types"] == {"mlp.0": "TurboQuantLinear", "mlp.2": "TurboQuantLinear", "head": "Linear"}
    assert r["same_params"], "the optimizer must hold the module's own parameters"
    assert r["loss_after"] < r["first_loss"]
    assert r["report"]["compressed_inputs"] == 2 and r["report"]["total"] < r["report"]["total_uncompressed"]
    assert r["resumed_plain"] and r["resumed_finite"] and r["resumed_steps"] == 12
