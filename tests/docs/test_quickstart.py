"""Every code block of docs/quickstart.md, run as a user would run it, on CPU.

A ``python title="FILE"`` block is written to FILE in a fresh directory, a ``bash`` block runs
there line by line (``pip install`` lines are checked against the extras pyproject.toml
defines instead: CI installs the package once, from the checkout), and the block titled as a
notebook cell runs in a Jupyter kernel. The parsing (which blocks, which commands) is in the
fast tier; the runs, which start 2 to 4 processes each, three copies at once, are slow
(~1.5 min in all).
"""
from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "quickstart.md"
OVERLAY = Path(sys.prefix) / "hf-overlay"  # transformers, where the Makefile installs it
NOTEBOOK_TITLE = "In a Jupyter notebook cell"
FENCE = re.compile(r'^```(\w+)(?:\s+title="([^"]*)")?\s*\n(.*?)^```\s*$', re.M | re.S)


def blocks() -> list[tuple[str, str | None, str]]:
    """(language, title, code) of every fenced block, in page order."""
    return [(m.group(1), m.group(2), m.group(3)) for m in FENCE.finditer(PAGE.read_text())]


def scripts() -> dict[str, str]:
    return {title: code for lang, title, code in blocks() if lang == "python" and title != NOTEBOOK_TITLE}


def commands() -> list[str]:
    """The commands of the bash blocks (comments stripped), but pip install."""
    out = []
    for lang, _, code in blocks():
        if lang == "bash":
            for line in code.splitlines():
                line = line.split("#", 1)[0].strip()
                if line and not line.startswith("pip install"):
                    out.append(line)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_block_is_a_script_a_command_or_the_notebook_cell():
    found = blocks()
    assert {lang for lang, _, _ in found} == {"python", "bash"}, found
    assert sum(title == NOTEBOOK_TITLE for _, title, _ in found) == 1
    # every script is run by exactly one command, and every command runs a script of the page
    runs = {}
    for command in commands():
        (script,) = [w for w in shlex.split(command) if w.endswith(".py")]
        runs[script] = command
    assert set(runs) == set(scripts()), (runs, scripts())
    for title, code in scripts().items():
        compile(code, title, "exec")
    assert len(scripts()) == 7  # Lightning, plain DDP, DiLoCo, DeMo, Accelerate, HF Trainer, sharded; + the notebook cell


def test_pip_install_lines_name_extras_that_exist():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = []
    for lang, _, code in blocks():
        for line in code.splitlines() if lang == "bash" else ():
            if line.startswith("pip install"):
                named += re.findall(r"lowbit-strategy\[([\w,]+)\]", line)
    assert named and {e for n in named for e in n.split(",")} <= extras, (named, extras)


def _environ(tmp_path: Path, transformers: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("LOWBIT_", "ACCELERATE_", "PET_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
           or k in ("LOWBIT_EMULATE_NCCL", "LOWBIT_LINK_ASSUME")}  # the suite's test modes (tests/conftest.py)
    path = [str(ROOT)]
    if transformers:  # the overlay after the environment's packages (tests/examples/with_overlay.py)
        site = tmp_path / "site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(f"import sys\nsys.path.append({str(OVERLAY)!r})\n")
        path.append(str(site))
    env.update(PYTHONPATH=os.pathsep.join(path + [env["PYTHONPATH"]] if env.get("PYTHONPATH") else path),
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
               HF_HOME=str(tmp_path / "hf_home"),  # no user-wide accelerate config
               TOKENIZERS_PARALLELISM="false")
    return env


def _with_port(command: str) -> str:
    """The page's command with a free rendezvous port: other runs on this machine may hold 29500."""
    port = _free_port()
    command = re.sub(r"\btorchrun\b", f"torchrun --master-port {port}", command, count=1)
    return re.sub(r"\baccelerate launch\b", f"accelerate launch --main_process_port {port}", command, count=1)


#: copies of each command run at once: the exit races a loaded machine exposes show up here
COPIES = 3


def _run_copies(command: str, cwd: Path, env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    """``command`` run :data:`COPIES` times at once, each in its own directory and port."""
    procs = []
    for i in range(COPIES):
        (cwd / str(i)).mkdir()
        for f in cwd.glob("*.py"):
            (cwd / str(i) / f.name).write_text(f.read_text())
        procs.append(subprocess.Popen(["bash", "-c", _with_port(command)], cwd=cwd / str(i), env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    done = []
    for p in procs:
        out, err = p.communicate(timeout=400)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


@pytest.mark.slow
@pytest.mark.parametrize("command", commands())
def test_command_runs_and_every_process_exits_cleanly(command, tmp_path):
    """Each front end's script, as the page gives it, run 3 times at once on this machine (6-12
    processes on its cores): every run exits 0, with no abort at interpreter exit (a job that
    trained and then aborted is reported as failed by its launcher; tests/collectives/
    test_chain.py has the cause)."""
    (script,) = [w for w in shlex.split(command) if w.endswith(".py")]
    code = scripts()[script]
    if "transformers" in code and not (OVERLAY / "transformers").is_dir():
        pytest.importorskip("transformers")
    (tmp_path / script).write_text(code)
    for proc in _run_copies(command, tmp_path, _environ(tmp_path, "transformers" in code)):
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        assert "terminate called" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.slow
def test_notebook_cell_runs_in_a_kernel(tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    (cell,) = [code for lang, title, code in blocks() if title == NOTEBOOK_TITLE]
    for k, v in _environ(tmp_path, transformers=False).items():
        monkeypatch.setenv(k, v)  # the kernel inherits this process's environment
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for o in nb.cells[0].outputs)
    assert "max_epochs=1` reached" in outputs, outputs[-3000:]
