"""Old import paths of moved modules: the same module object, a DeprecationWarning at the importer."""
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lowbit_strategy  # noqa: F401  installs the finder
from lowbit_strategy import _moved

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_path_is_the_new_module_with_a_warning(old):
    new = importlib.import_module(_moved.MOVED[old])
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {_moved.MOVED[old]}") as got:
        __import__(old)  # as an import statement does (importlib.import_module adds a frame)
    assert sys.modules[old] is new
    assert new.__name__ == new.__spec__.name == _moved.MOVED[old]  # its own spec, not the alias's
    assert got[0].filename == __file__  # attributed to the importer, not to importlib


def test_from_package_import_and_the_moved_names():
    import lowbit_strategy.collectives as package
    from lowbit_strategy.pricing import flat

    sys.modules.pop("lowbit_strategy.collectives.cost_model", None)
    package.__dict__.pop("cost_model", None)  # an earlier import left it as an attribute
    with pytest.warns(DeprecationWarning, match="pricing.flat"):
        from lowbit_strategy.collectives import cost_model
    assert cost_model is flat
    with pytest.warns(DeprecationWarning, match="lowbit_strategy.pricing.flat.cheapest") as got:
        from lowbit_strategy.collectives import cheapest
    assert cheapest is flat.cheapest and got[0].filename == __file__
    with pytest.raises(ImportError):
        from lowbit_strategy.collectives import no_such_name  # noqa: F401


def test_no_old_path_is_a_file_and_every_new_one_is():
    """The finder answers only for modules that are gone (a file at the old path would win)."""
    for old, new in _moved.MOVED.items():
        assert Path(importlib.util.find_spec(new).origin).is_file(), new
        old_file = ROOT / (old.replace(".", "/") + ".py")
        assert not old_file.exists(), f"{old_file} exists: remove it or its MOVED entry"


@pytest.mark.slow
def test_a_script_sees_the_warning_under_default_filters():
    """Python shows a DeprecationWarning by default only where ``__main__`` triggers it."""
    code = "import lowbit_strategy.collectives.link_probe"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr
    assert "DeprecationWarning: lowbit_strategy.collectives.link_probe moved to lowbit_strategy.pricing.link_probe" in out.stderr


@pytest.mark.parametrize("module, name, new", [
    ("lowbit_strategy.collectives.reference", "full_allreduce", "lowbit_strategy.collectives.exact.full_allreduce"),
    ("lowbit_strategy.collectives.reference", "ExactMean", "lowbit_strategy.collectives.exact.ExactMean"),
    ("lowbit_strategy.collectives.fsdp_reduce_scatter", "reference",
     "lowbit_strategy.collectives.reference.fsdp_reduce_scatter_reference"),
    ("lowbit_strategy.collectives", "Layout", "lowbit_strategy.collectives.gathered.PayloadLayout"),
    ("lowbit_strategy.collectives.gathered", "Layout", "lowbit_strategy.collectives.gathered.PayloadLayout"),
    ("lowbit_strategy.collectives.gathered_two_stage", "chunk_plan", "lowbit_strategy.collectives.gathered_two_stage.chunking"),
    ("lowbit_strategy.buckets", "plan", "lowbit_strategy.buckets.partition"),
    ("lowbit_strategy.algorithms.lion_cub", "Plan", "lowbit_strategy.algorithms.lion_cub.mode.SyncMode"),
    ("lowbit_strategy.algorithms.lion_cub.mode", "WARMUP_PLAN", "lowbit_strategy.algorithms.lion_cub.mode.WARMUP_MODE"),
])
def test_moved_names_resolve_at_their_old_place_with_a_warning(module, name, new):
    old = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{module}.{name} moved to {new}")) as got:
        value = getattr(old, name)
    home, attr = new.rsplit(".", 1)
    assert value is getattr(importlib.import_module(home), attr) and got[0].filename == __file__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        old.nope  # noqa: B018
