# Targets create/refresh the virtual environment they need. The CPU build of torch is
# pinned through constraints/cpu.txt here and in CI only; the package itself asks for
# a range (torch>=2.4).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP_INSTALL := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints/cpu.txt

.PHONY: venv lint docs test test-fast demo bench bench-quick bench-codecs clean

$(STAMP): pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) -e ".[dev]"
	# transformers, datasets, TRL and tensorboardX (the Hugging Face paths: the notebook,
	# LowBitTrainer, SFTTrainer) beside the environment, not in it: see pyproject.toml's dev
	# extra; tests/examples/tiny_hf.py and with_overlay.py add it to the tests that need it.
	# TRL without its dependencies: they are all there already (accelerate in the environment),
	# and --target would otherwise put a second torch in the overlay.
	$(PIP_INSTALL) --upgrade --target $(VENV)/hf-overlay "transformers>=4.46" "datasets>=4.7" "tensorboardX>=2.6"
	$(PIP_INSTALL) --upgrade --no-deps --target $(VENV)/hf-overlay "trl>=0.20"
	touch $(STAMP)

venv: $(STAMP)

# ruff (lint, import order, format) and mypy over the library, configured in pyproject.toml
lint: $(STAMP)
	$(VENV)/bin/ruff check lowbit_strategy callbacks
	$(VENV)/bin/ruff format --check lowbit_strategy callbacks
	$(VENV)/bin/mypy

# The docs site (mkdocs.yml, docs/) into site/, strict: a broken link or anchor, a page missing
# from the nav, or an API entry that does not resolve fails. A few seconds; mkdocstrings reads the
# source without importing it (no GPU, no Lightning import). Browse: open site/index.html.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

# The whole suite, then the fast tier again on torch's scalar CPU kernels (ATEN_CPU_CAPABILITY=
# default instead of this CPU's AVX2/AVX-512 ones): every float a test compares is computed on
# the machine running it, under whichever kernels it runs, and this shows it on a second path.
test: lint docs
	$(PY) -m pytest -q
	ATEN_CPU_CAPABILITY=default $(PY) -m pytest -q -m "not slow"

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# Lion lr 5e-4: the better of the two measured in the README (Model quality: Lion Cub modes);
# also writes the trained weights, which examples/finetune.ipynb fine-tunes when it finds them.
# The link is given (a 1 Gbit/s cluster link): measured, this machine's loopback is fast enough
# that Lion Cub's auto mode would rightly fall back to bf16 (what DDP bf16 sends) and save little.
demo: $(STAMP)
	$(PY) examples/gpt_lion.py --devices 2 --max-minutes 3 --lr 5e-4 --save-weights checkpoints/gpt_demo.pt \
	    --lowbit link_bandwidth_gbps=1 link_latency_us=50

bench-codecs: $(STAMP)
	$(PY) -m benchmarks.codecs

bench-quick: $(STAMP)
	$(PY) -m benchmarks.collectives --quick

bench: $(STAMP)
	$(PY) -m benchmarks.codecs
	$(PY) -m benchmarks.collectives

.PHONY: bench-e2e bench-e2e-quick gpu-check demo-hf bench-nodes

# 2 emulated nodes x 2 ranks, flat against hierarchical for DDP and every algorithm, at 1 Gbit/s
# and 100 Mbit/s between nodes (root; benchmarks/nodes/driver.py -> benchmarks/results/nodes/nodes.md)
bench-nodes: $(STAMP)
	$(PY) -m benchmarks.nodes --topologies flat hierarchical

# Hugging Face Trainer with LowBitTrainer on 2 processes (examples/hf_trainer_finetune.py), with
# transformers/datasets/TRL from the overlay; try LOWBIT_ALGORITHM=bitdp or HF_ARGS="--trainer sft"
demo-hf: $(STAMP)
	LOWBIT_CONFIG=$${LOWBIT_CONFIG:-examples/lowbit.yaml} PYTHONPATH=$(VENV)/hf-overlay \
	    $(VENV)/bin/torchrun --nproc-per-node 2 examples/hf_trainer_finetune.py $(HF_ARGS)

# The first command on a machine with GPUs: Triton kernels compiled and bit-exact, the kernel
# benchmark, ranks sharing the GPU over gloo, where the time goes (benchmarks/gpu_check/). Exits 0 without a GPU.
# No install: a GPU machine often has torch, Triton and Lightning and no network, so this uses
# .venv when it exists and the machine's python3 otherwise, from this checkout (PYTHONPATH=.).
gpu-check:
	PYTHONPATH=. $(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m benchmarks.gpu_check --out benchmarks/results/gpu

# End-to-end GPT training on emulated 1 Gbit/s and 100 Mbit/s links (root; see benchmarks/e2e/driver.py)
bench-e2e-quick: $(STAMP)
	$(PY) -m benchmarks.e2e --quick

bench-e2e: $(STAMP)
	$(PY) -m benchmarks.e2e

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis site

.PHONY: bench-ttq bench-ttq-quick

# Time to quality: steps and seconds to DDP fp32 + AdamW's loss at 80 % of the run, per
# method, at 2 emulated nodes x 2 ranks over 1 Gbit/s and 100 Mbit/s (root; benchmarks/ttq/driver.py ->
# benchmarks/results/ttq/). The full study takes many hours on a 2-core machine: it keeps every run
# as JSON and continues where it stopped (`TTQ_ARGS=--retime` also times again what older code
# timed, before the final tables). `make bench-ttq TTQ_ARGS=--quick` (= bench-ttq-quick):
# every stage on a small model in <= 10 minutes -> benchmarks/results/ttq/quick/
bench-ttq: $(STAMP)
	$(PY) -m benchmarks.ttq --skip-existing $(TTQ_ARGS)

bench-ttq-quick: $(STAMP)
	$(PY) -m benchmarks.ttq --quick $(TTQ_ARGS)
