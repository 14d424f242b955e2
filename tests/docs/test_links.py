"""README.md and the docs' sources (docs/**/*.md), as GitHub shows them: every relative link
and image resolves to a file of the repository, every in-page anchor link to a heading; and
the API reference has an entry for every name the package root and ``callbacks`` export.
Reads files only (no import), so it belongs to the fast tier. The built site is checked by
``make docs`` (strict)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def _links(text: str) -> list[str]:
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out += LINK.findall(re.sub(r"`[^`]*`", "", line))  # not inside code spans
    return out


def _anchor(heading: str) -> str:
    """GitHub's (and MkDocs' toc) slug of a heading, for the plain headings these pages use."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text, fenced, out = path.read_text(), False, set()
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.*)$", line)):
            out.add(_anchor(m.group(1)))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.is_file() or ROOT not in file.parents:
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_readme_is_short_and_points_into_the_docs():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "docs/quickstart.md" in text and "docs/choosing.md" in text
    assert "../shared" not in text and not any("../shared" in p.read_text() for p in PAGES)


def _exported(module_file: Path) -> list[str]:
    tree = ast.parse(module_file.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"no __all__ in {module_file}")


def test_api_reference_documents_every_exported_name():
    entries = set()
    for page in (ROOT / "docs" / "api").glob("*.md"):
        entries |= set(re.findall(r"^::: ([\w.]+)", page.read_text(), re.M))
    short = {e.rsplit(".", 1)[-1] for e in entries}
    missing = [n for n in _exported(ROOT / "lowbit_strategy" / "__init__.py") if n not in short]
    missing += [n for n in _exported(ROOT / "callbacks" / "__init__.py") if f"callbacks.{n}" not in entries]
    assert not missing, missing
