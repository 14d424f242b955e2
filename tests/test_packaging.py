"""The released package: build the wheel and the sdist from this tree, install the wheel into a
fresh virtual environment, and import every public name from there.

The fresh environment gets its dependencies (torch, Lightning, Accelerate, ...) from the test
environment's site-packages through a path entry, so nothing is downloaded; the wheel itself
is installed with ``--no-deps`` and must be what ``import lowbit_strategy`` finds (not this
source tree, not the test environment's editable install).
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: modules users import, each checked name by name (every name in its __all__)
PUBLIC = (
    "lowbit_strategy",
    "lowbit_strategy.codecs",
    "lowbit_strategy.collectives",
    "lowbit_strategy.nn",
    "lowbit_strategy.algorithms",
    "lowbit_strategy.accelerate",
    "lowbit_strategy.hf",
    "callbacks",
)

IMPORT_ALL = """
import importlib, json, sys
out = {}
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    out[name] = {"file": module.__file__, "names": len(module.__all__), "missing": missing}
import lowbit_strategy
out["version"] = lowbit_strategy.__version__
out["LowBitStrategy"] = lowbit_strategy.LowBitStrategy.__name__
print(json.dumps(out))
"""


def _build(tmp: Path) -> tuple[Path, Path]:
    """Wheel and sdist built from a copy of what a release holds (a build in the checkout
    itself would reuse a stale build/ directory, which setuptools never cleans)."""
    src, dist = tmp / "src", tmp / "dist"
    junk = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("lowbit_strategy", "callbacks"):
        shutil.copytree(ROOT / part, src / part, ignore=junk)
    for part in ("pyproject.toml", "README.md", "CHANGELOG.md"):
        shutil.copy(ROOT / part, src / part)
    # --no-isolation: the test environment's setuptools and wheel build it, offline
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--sdist", "--outdir", str(dist),
                    str(src)], check=True, capture_output=True, text=True, timeout=300)
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    return wheel, sdist


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_environment_and_exports_every_public_name(tmp_path):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    wheel, sdist = _build(tmp_path)
    assert wheel.name == f"lowbit_strategy-{version}-py3-none-any.whl"
    assert sdist.name == f"lowbit_strategy-{version}.tar.gz"

    # the wheel holds the library and callbacks (with their py.typed markers), nothing else
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"lowbit_strategy", "callbacks"}, tops
    assert {"lowbit_strategy/py.typed", "callbacks/py.typed"} <= set(names)
    assert "lowbit_strategy/integrations/accelerate.py" in names and "lowbit_strategy/accelerate.py" in names
    assert "lowbit_strategy/integrations/hf.py" in names and "lowbit_strategy/hf.py" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names)
    # the sdist carries the sources and the metadata a rebuild needs
    members = tarfile.open(sdist).getnames()
    assert any(m.endswith("/pyproject.toml") for m in members)
    assert any(m.endswith("/lowbit_strategy/__init__.py") for m in members)

    env = tmp_path / "venv"
    venv.create(env, with_pip=True)
    py = env / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    # dependencies from the test environment, after the fresh environment's own site-packages
    fresh_site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                     check=True, capture_output=True, text=True).stdout.strip())
    # (and transformers from the Makefile's overlay, for lowbit_strategy.hf)
    overlay = Path(sys.prefix) / "hf-overlay"
    (fresh_site / "zz_test_dependencies.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n{overlay}\n")

    environ = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([str(py), "-c", IMPORT_ALL, *PUBLIC], cwd=tmp_path, env=environ, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["version"] == version
    assert got["LowBitStrategy"] == "LowBitStrategy"
    for name in PUBLIC:
        assert got[name]["missing"] == [], (name, got[name])
        assert got[name]["names"] > 0
        assert got[name]["file"].startswith(str(fresh_site)), (name, got[name]["file"])  # the wheel, not the tree
