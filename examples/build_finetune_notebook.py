"""Writes ``examples/finetune.ipynb`` from the cells below (outputs empty).

The notebook's source of truth is this file: edit the cells here, run
``python examples/build_finetune_notebook.py``, then execute the notebook to fill its
outputs (``python examples/build_finetune_notebook.py --execute``, about four minutes on
two CPU cores). ``tests/examples/test_finetune_notebook.py`` checks that the committed
notebook's cells are these.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
NOTEBOOK = HERE / "finetune.ipynb"

CELLS = [
    ("md", """\
# Fine-tune a pretrained language model with fewer bytes on the wire

This notebook fine-tunes a pretrained causal language model on new text with two processes
forked from this kernel (`Trainer(strategy="lowbit_lion_notebook", devices=2)`), then does
the same with BitDP's 2-bit gradients and AdamW (`"lowbit_bitdp_notebook"`), each next to
plain DDP with the same optimizer as the uncompressed reference. It shows the loss curves,
the bytes each rank sent per step against DDP's fp32 allreduce, and a few generated samples
before and after.

It runs top to bottom on two CPU cores in three to four minutes, offline. With a larger
Hugging Face model, lower `FINETUNE_STEPS` and `BATCH` in the next cell first, and mind the
memory: the notebook keeps the pretrained model and each run's fine-tuned copy.

**Pretrained weights**, the first that exists of:
1. a Hugging Face causal LM in a local directory: set `LOWBIT_HF_MODEL=/path/to/model`
   before starting Jupyter (needs `pip install "lowbit-strategy[hf]"`);
2. the weights `make demo` writes (`checkpoints/gpt_demo.pt`: a byte-level GPT trained for
   three minutes on Python's standard library with `lowbit_lion`);
3. otherwise the notebook pretrains that GPT here first, for about a minute.

**New text**: the Python Language Reference (`pydoc_data.topics`, installed with Python),
English prose, where the model was pretrained on source code."""),
    ("code", """\
import logging
import os
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets: no widgets needed
import torch
import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Subset

ROOT = Path.cwd().parent if Path.cwd().name == "examples" else Path.cwd()  # the repository
sys.path.insert(0, str(ROOT))

import lowbit_strategy  # registers the lowbit_* strategy names with Lightning
from callbacks import CommStats
from lowbit_strategy.collectives.wire import allreduce_bytes
from examples.causal_lm import ByteTokenizer, HFCausalLM, reference_manual_text, split_windows
from examples.gpt_lion import GPT, Windows, stdlib_bytes

QUICK = os.environ.get("LOWBIT_NOTEBOOK_QUICK") == "1"  # a shorter run (the test suite's)
HF_MODEL = os.environ.get("LOWBIT_HF_MODEL", "")
WEIGHTS = Path(os.environ.get("LOWBIT_DEMO_WEIGHTS", ROOT / "checkpoints" / "gpt_demo.pt"))
LOGS = Path(os.environ.get("LOWBIT_NOTEBOOK_LOGS", ROOT / "lightning_logs" / "finetune"))
FINETUNE_STEPS = 20 if QUICK else 100
PRETRAIN_STEPS = 20 if QUICK else 200
BATCH = 16  # windows per rank and step
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # a Hugging Face tokenizer is used before the forks
for name in ("lightning.pytorch", "lightning.fabric"):  # keep warnings, drop the start-up banners
    logging.getLogger(name).setLevel(logging.WARNING)
warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # a deprecation inside Lightning, not ours
pl.seed_everything(0, verbose=False)
print(f"torch {torch.__version__}, lightning {pl.__version__}, {os.cpu_count()} CPU cores")"""),
    ("md", """\
## 1. The pretrained model

A Hugging Face model brings its own tokenizer; the GPT reads bytes. Fine-tuning copies this
model, so every run below starts from the same weights."""),
    ("code", """\
pretrained = None
if HF_MODEL:
    pretrained = HFCausalLM(HF_MODEL)
    tokenizer, source = pretrained.tokenizer, f"Hugging Face model from {HF_MODEL}"
elif WEIGHTS.exists():
    pretrained = GPT.load_weights(WEIGHTS)
    tokenizer, source = ByteTokenizer(), f"GPT weights from make demo ({os.path.relpath(WEIGHTS, ROOT)})"
else:
    tokenizer, source = ByteTokenizer(), f"GPT pretrained here for {PRETRAIN_STEPS} steps"
print(source)"""),
    ("md", """\
No weights yet? Then pretrain the byte-level GPT on the standard library's source code, in
this process, with AdamW (skipped when weights were found above)."""),
    ("code", """\
if pretrained is None:
    code = stdlib_bytes(2 * 2**20)
    pretrained = GPT(optimizer="adamw", lr=3e-3, warmup=20, total_steps=PRETRAIN_STEPS)
    warnings.filterwarnings("ignore", message=".*no `val_dataloader`.*")  # pretraining has no validation
    start = time.perf_counter()
    pl.Trainer(accelerator="cpu", devices=1, max_steps=PRETRAIN_STEPS, logger=False,
               enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False).fit(
        pretrained, DataLoader(Windows(code, 128), batch_size=BATCH * 2, shuffle=True, drop_last=True))
    print(f"pretrained {sum(p.numel() for p in pretrained.parameters()) / 1e6:.2f}M parameters "
          f"in {time.perf_counter() - start:.0f} s")"""),
    ("md", """\
## 2. The new text, and the model on it before fine-tuning"""),
    ("code", """\
tokens = torch.tensor(tokenizer.encode(reference_manual_text()))
train_set, val_set = split_windows(tokens, seq=min(128, pretrained.context))
val_set = Subset(val_set, range(min(len(val_set), 20 * BATCH)))  # the same windows on 1 or 2 ranks
train_loader = DataLoader(train_set, batch_size=BATCH, shuffle=True, drop_last=True)
val_loader = DataLoader(val_set, batch_size=BATCH)

quiet = dict(accelerator="cpu", logger=False, enable_checkpointing=False, enable_model_summary=False,
             enable_progress_bar=False)
before = pl.Trainer(devices=1, **quiet).validate(pretrained, val_loader, verbose=False)[0]["val_loss"]
print(f"{len(tokens):,} tokens of new text ({len(train_set)} training windows of {train_set.seq}, "
      f"{len(val_set)} held out); "
      f"validation loss before fine-tuning: {before:.3f}")

PROMPTS = ["The ", "A class "]


def samples(model, new_tokens=120):
    return {p: tokenizer.decode(model.generate(tokenizer.encode(p), new_tokens, seed=0)) for p in PROMPTS}


samples_before = samples(pretrained)
for text in samples_before.values():
    print(repr(text), end="\\n\\n")"""),
    ("md", """\
## 3. Fine-tune: Lion Cub and BitDP + AdamW, each next to uncompressed DDP

Each run forks two training processes from this kernel (the `_notebook` strategies, like
Lightning's `ddp_notebook`). The `CommStats` callback logs the bytes this rank sent each step
(`comm/bytes_per_step`, and `comm_MB` / `comm_x` in a script's progress bar); here rank 0
prints a line every few steps, and a CSV logger keeps every step for the plot. When `fit`
returns, the trained weights are back in this process.

Every compressed run has a reference: the same optimizer, learning rate and data order under
Lightning's plain `ddp_notebook` (fp32 gradient allreduce), so the difference between the
two is what compression costs. `lowbit_lion` lets its cost model choose the wire format per
bucket (with two ranks on one machine it picks 8-bit L1 lanes, 4x less than fp32);
`lowbit_lion_1bit_notebook` sends the 1-bit majority vote (32x less)."""),
    ("code", """\
import csv

n_params = sum(p.numel() for p in pretrained.parameters() if p.requires_grad)
ddp_bytes = allreduce_bytes(4 * n_params, 2)  # DDP's ring allreduce of fp32 gradients, per rank and step


class PrintProgress(pl.Callback):
    \"\"\"Rank 0 prints loss and bytes every ``every`` steps (a forked rank cannot draw widgets).\"\"\"

    def __init__(self, every):
        self.every = every

    def on_train_batch_end(self, trainer, *args):
        m, step = trainer.callback_metrics, trainer.global_step
        if trainer.is_global_zero and step % self.every == 0:
            sent = f"{float(m['comm_MB']) * 1024:,.0f} KiB sent" if m.get("comm_x") else "fp32 allreduce"
            sys.stdout.write(f"  step {step:4d}/{trainer.max_steps}  loss {float(m['train_loss']):.3f}  {sent}\\n")
            sys.stdout.flush()


def finetune(strategy, optimizer, lr):
    model = pretrained.with_hparams(optimizer=optimizer, lr=lr, warmup=10, total_steps=FINETUNE_STEPS)
    logger = CSVLogger(LOGS, name=strategy)
    log_dir = Path(logger.log_dir)  # fixes the version here, before the ranks fork
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=FINETUNE_STEPS, logger=logger,
        log_every_n_steps=1, val_check_interval=max(1, FINETUNE_STEPS // 2), check_val_every_n_epoch=None,
        num_sanity_val_steps=0, callbacks=[CommStats(), PrintProgress(every=max(1, FINETUNE_STEPS // 4))],
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False)
    print(f"{strategy} with {optimizer}, lr {lr:g}")
    pl.seed_everything(0, verbose=False)  # the same data order in every run
    start = time.perf_counter()
    trainer.fit(model, train_loader, val_loader)
    seconds = time.perf_counter() - start
    with open(log_dir / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    series = lambda key: [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
    sent = [b for _, b in series("comm/bytes_per_step")]
    recorded = isinstance(trainer.strategy, lowbit_strategy.LowBitStrategy)  # plain DDP records no traffic
    return dict(model=model, seconds=seconds, train=series("train_loss"), val=series("val_loss"),
                bytes_per_step=sum(sent) / len(sent) if recorded else ddp_bytes,
                last_step_bytes=sent[-1] if recorded else ddp_bytes)


gpt = not HF_MODEL  # a pretrained Hugging Face model wants smaller steps
LR = {"lion": 3e-4 if gpt else 1e-5, "adamw": 1e-3 if gpt else 3e-5}
runs = {
    "Lion Cub": finetune("lowbit_lion_notebook", "lion", LR["lion"]),
    "DDP + Lion": finetune("ddp_notebook", "lion", LR["lion"]),
    "BitDP 2-bit + AdamW": finetune("lowbit_bitdp_notebook", "adamw", LR["adamw"]),
    "DDP + AdamW": finetune("ddp_notebook", "adamw", LR["adamw"]),
}
REFERENCE = {"Lion Cub": "DDP + Lion", "BitDP 2-bit + AdamW": "DDP + AdamW"}"""),
    ("md", """\
## 4. Loss and bytes on the wire

Training loss as a running mean over 10 steps, validation loss as dots (the held-out text is
the manual's last topics, which the model finds easier than the average training window, so
the dots sit below the curves). DDP's fp32 ring allreduce sends `2 (P-1)/P · 4 · N` bytes per
rank and step for `N` trainable parameters; the low-bit runs' bytes are what their collectives
recorded, averaged over every step (BitDP sends its first two steps in fp32, so its last step,
as in the progress lines, sends less than its mean)."""),
    ("code", """\
import matplotlib.pyplot as plt
from IPython.display import Markdown, display

STYLE = {"Lion Cub": ("C0", "-"), "DDP + Lion": ("C0", ":"), "BitDP 2-bit + AdamW": ("C1", "-"),
         "DDP + AdamW": ("C1", ":")}


def running_mean(values, window=10):
    return [sum(values[max(0, i - window + 1): i + 1]) / len(values[max(0, i - window + 1): i + 1])
            for i in range(len(values))]


fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [3, 2]})
for name, run in runs.items():
    color, ls = STYLE[name]
    steps, losses = zip(*run["train"])
    left.plot(steps, running_mean(list(losses)), color=color, ls=ls, label=name)
    left.plot(*zip(*run["val"]), "o", color=color, mfc="white" if ls == ":" else color)
left.axhline(before, color="grey", lw=0.8, ls="--", label="validation before fine-tuning")
left.set(xlabel="optimizer step", ylabel="loss (nats per token)", title="Fine-tuning on the new text (2 ranks)")
left.legend(fontsize=8)
names = list(runs)
kib = [runs[n]["bytes_per_step"] / 2**10 for n in names]
bars = right.barh(names, kib, color=[STYLE[n][0] for n in names], alpha=0.85)
for bar, n in zip(bars, names):
    bar.set_hatch("//" if STYLE[n][1] == ":" else "")
right.bar_label(bars, labels=[f"{ddp_bytes / runs[n]['bytes_per_step']:.1f}x less" if n in REFERENCE else "fp32"
                              for n in names], padding=3)
right.set(xlabel="KiB sent per rank and step", title="Bytes on the wire", xlim=(0, max(kib) * 1.3))
right.invert_yaxis()
fig.tight_layout()
plt.show()

table = ["| run | KiB sent per rank and step | less than DDP | last step | final validation loss "
         "| against its reference | fit time |", "|---|---:|---:|---:|---:|---:|---:|"]
for name, run in runs.items():
    ref = runs.get(REFERENCE.get(name))
    delta = f"{run['val'][-1][1] - ref['val'][-1][1]:+.3f}" if ref else "reference"
    table.append(f"| {name} | {run['bytes_per_step'] / 2**10:,.1f} | {ddp_bytes / run['bytes_per_step']:.1f}x "
                 f"| {run['last_step_bytes'] / 2**10:,.1f} | {run['val'][-1][1]:.3f} | {delta} | {run['seconds']:.0f} s |")
display(Markdown("\\n".join(table)))"""),
    ("md", """\
## 5. Samples before and after

Same prompts, same sampling seed (temperature 0.8, top-40), before fine-tuning and after
each run."""),
    ("code", """\
after = {name: samples(run["model"]) for name, run in runs.items()}
for prompt in PROMPTS:
    print(f"=== prompt {prompt!r}")
    print(f"--- before fine-tuning\\n{samples_before[prompt]}\\n")
    for name, texts in after.items():
        print(f"--- after {name}\\n{texts[prompt]}\\n")"""),
    ("md", """\
The same three ways in, outside a notebook: `Trainer(strategy="lowbit_lion")` in a script
(`examples/gpt_lion.py`), `LowBitAccelerator` under `accelerate launch`
(`examples/accelerate_gpt.py`), or `lowbit_strategy.attach` on a plain DDP model. See the
README."""),
]


def build() -> nbformat.NotebookNode:
    nb = new_notebook(cells=[new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 1200, env: dict | None = None,
            append_path: str | None = None) -> nbformat.NotebookNode:
    """Runs every cell in a fresh kernel started in ``examples/`` (as Jupyter would), with
    ``env`` added to this process's environment and ``append_path`` appended to the kernel's
    ``sys.path`` (after its own packages, unlike ``PYTHONPATH``) before the first cell."""
    import os

    from nbclient import NotebookClient

    extra = [f"--IPKernelApp.exec_lines=import sys; sys.path.append({append_path!r})"] if append_path else []
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}},
                            extra_arguments=extra)
    client.execute(env={**os.environ, **(env or {})})
    return nb


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--execute", action="store_true", help="run it and keep the outputs")
    args = p.parse_args(argv)
    nb = build()
    if args.execute:
        execute(nb)
    nbformat.write(nb, NOTEBOOK)
    print(f"wrote {NOTEBOOK}")


if __name__ == "__main__":
    main()
