"""examples/finetune.ipynb, executed headless in a fresh Jupyter kernel (nbclient) as a user
runs it: offline (pretraining the GPT in its first cells) and from a local Hugging Face
model. ``LOWBIT_NOTEBOOK_QUICK=1`` shortens its runs; everything else is the notebook."""
import base64
import math
import re

import nbformat
import pytest

from examples.build_finetune_notebook import NOTEBOOK, build, execute
from examples.gpt_lion import GPT
from tests.examples.tiny_hf import use_transformers, write_tiny_gpt2

RUNS = ["Lion Cub", "DDP + Lion", "BitDP 2-bit + AdamW", "DDP + AdamW"]


def test_committed_notebook_holds_the_builders_cells():
    committed, built = nbformat.read(NOTEBOOK, as_version=4), build()
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in built.cells], (
        "examples/finetune.ipynb differs from examples/build_finetune_notebook.py: edit the cells there and run "
        "`python examples/build_finetune_notebook.py --execute`")
    nbformat.validate(committed)


def _run(tmp_path, append_path=None, **env) -> list[nbformat.NotebookNode]:
    nb = build()
    # a 1 Mbit/s link for Lion Cub's auto plan: its 8-bit lanes win decisively (on 1 Gbit/s, the
    # tests' default, a model this small ties 8-bit codes against bf16's cast, and the plan is noise)
    execute(nb, timeout=600, env={"LOWBIT_NOTEBOOK_QUICK": "1", "LOWBIT_NOTEBOOK_LOGS": str(tmp_path / "logs"),
                                  "LOWBIT_LINK_ASSUME": "0.001,50", **env},
            append_path=append_path)
    return [c for c in nb.cells if c.cell_type == "code"]


def _text(cell) -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def _displays(cells, mime) -> list[str]:
    return [o.data[mime] for c in cells for o in c.outputs if o.output_type == "display_data" and mime in o.data]


def _table(cells) -> dict[str, list[str]]:
    """The bytes table's rows by run name (the Markdown the notebook displays)."""
    (markdown,) = [m for m in _displays(cells, "text/markdown") if m.startswith("| run |")]
    rows = [line.strip("|").split("|") for line in markdown.splitlines()[2:]]
    return {r[0].strip(): [x.strip() for x in r[1:]] for r in rows}


def _check_common(cells, tmp_path, bitdp_at_least: float) -> dict[str, list[str]]:
    (png,) = _displays(cells, "image/png")  # the loss curves and bytes chart
    assert base64.b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    before = float(re.search(r"validation loss before fine-tuning: ([0-9.]+)", "".join(map(_text, cells))).group(1))
    table = _table(cells)
    assert list(table) == RUNS
    for name, (kib, less, last, val, against, seconds) in table.items():
        assert math.isfinite(float(val)) and float(val) < before, (name, val, before)  # fine-tuning helped
        if name.startswith("DDP"):
            assert less == "1.0x" and against == "reference"
        else:  # within 0.1 nats of the same optimizer under plain DDP, after the same steps on the same data
            assert abs(float(against)) < 0.1, (name, against)
    assert float(table["Lion Cub"][1].rstrip("x")) >= 3.9  # 8-bit lanes at least
    assert float(table["BitDP 2-bit + AdamW"][1].rstrip("x")) > bitdp_at_least
    bitdp_mean, bitdp_last = (float(table["BitDP 2-bit + AdamW"][i].replace(",", "")) for i in (0, 2))
    assert bitdp_last < bitdp_mean  # the first steps went in fp32 (BitDP's warm-up)
    assert table["Lion Cub"][0] == table["Lion Cub"][2]  # Lion Cub compresses from the first step
    samples = _text(cells[-1])
    for name in RUNS:
        assert f"--- after {name}\n" in samples
    blocks = samples.split("--- ")
    assert len({b.split("\n", 1)[1] for b in blocks if b.startswith(("before", "after"))}) > 5, "samples changed"
    # every run's per-step log, written by the forked rank 0
    assert sorted(p.parent.parent.name for p in (tmp_path / "logs").glob("*/version_*/metrics.csv")) == sorted(
        ["lowbit_lion_notebook", "ddp_notebook", "lowbit_bitdp_notebook", "ddp_notebook"])
    return table


@pytest.mark.slow
def test_notebook_runs_offline_pretraining_its_own_gpt(tmp_path):
    cells = _run(tmp_path, LOWBIT_DEMO_WEIGHTS=str(tmp_path / "no-weights.pt"), LOWBIT_HF_MODEL="")
    assert "GPT pretrained here for 20 steps" in _text(cells[1]) and "pretrained 1.85M parameters" in _text(cells[2])
    table = _check_common(cells, tmp_path, bitdp_at_least=4)  # 2-bit linear weights, fp32 embeddings
    n = sum(p.numel() for p in GPT().parameters())  # the tied head counted once, as DDP sends it
    assert table["DDP + AdamW"][0] == f"{2 * (2 - 1) / 2 * 4 * n / 1024:,.1f}"  # the ring allreduce's bytes, P = 2
    progress = _text(cells[4])
    assert progress.count("KiB sent") == 2 * 4 and progress.count("fp32 allreduce") == 2 * 4  # 4 lines a run


@pytest.mark.slow
def test_notebook_fine_tunes_a_local_hugging_face_model(tmp_path):
    overlay = use_transformers()  # the kernel imports transformers from there too
    model = write_tiny_gpt2(tmp_path / "tiny-gpt2")
    cells = _run(tmp_path, append_path=overlay, LOWBIT_HF_MODEL=str(model))
    assert f"Hugging Face model from {model}" in _text(cells[1])
    assert _text(cells[2]) == ""  # no pretraining
    # 12k of the tiny model's 38k parameters are the (tied) embeddings, which BitDP keeps fp32
    _check_common(cells, tmp_path, bitdp_at_least=2)
