"""Run a script with ``<venv>/hf-overlay`` appended to ``sys.path`` (after the environment's own
packages, unlike ``PYTHONPATH``): ``python tests/examples/with_overlay.py SCRIPT ARGS...``.

The launcher (``torchrun``) starts each process with it, so that the Hugging Face examples
find transformers, datasets and TRL where the Makefile installs them (see ``tiny_hf.py``)."""
import runpy
import sys
from pathlib import Path

sys.path.append(str(Path(sys.prefix) / "hf-overlay"))
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
