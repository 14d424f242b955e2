"""docs/layout.md names every module of the library and of ``callbacks``, each under its folder."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("lowbit_strategy", "callbacks")
#: the column where an entry's description starts: a line indented this far continues the entry above
DESCRIPTION_COLUMN = 20


def named_in_layout() -> set[str]:
    """Paths (``lowbit_strategy/collectives/wire.py``) the page's tree names: an entry's own name
    under its folder, and the ``x.py`` a folder's description lists."""
    block = re.search(r"```\n(.*?)```", (ROOT / "docs" / "layout.md").read_text(), re.S).group(1)
    names: set[str] = set()
    stack: list[tuple[int, str]] = []  # (indent, folder path) of the open folders
    entry = ""  # the folder whose description a continuation line extends
    for line in block.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent >= DESCRIPTION_COLUMN:  # a continuation of the entry above
            names.update(f"{entry}/{m}" for m in re.findall(r"\b(\w+\.py)\b", line) if entry)
            continue
        token, _, text = line.strip().partition(" ")
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        path = f"{parent}/{token}".strip("/").rstrip("/")
        if token.endswith("/"):
            stack.append((indent, path))
            names.add(f"{path}/__init__.py")
            entry = path
            names.update(f"{path}/{m}" for m in re.findall(r"\b(\w+\.py)\b", text))
        else:
            names.add(path)
            entry = ""
    return names


def test_the_layout_page_names_every_module():
    modules = {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    missing = sorted(modules - named_in_layout())
    assert not missing, f"docs/layout.md does not name {missing}: add each under its folder"


def test_the_layout_page_names_no_module_that_is_gone():
    named = {n for n in named_in_layout() if n.startswith(PACKAGES) and n.endswith(".py")}
    gone = sorted(n for n in named if not (ROOT / n).is_file())
    assert not gone, f"docs/layout.md names {gone}, which do not exist"
