"""MkDocs hooks: the docs link to files outside ``docs/`` (benchmark results, examples) with
paths relative to their own source file, so that the same links work on GitHub. The site has
no such files; these hooks add every linked one under ``_repo/`` and rewrite the links to it,
so ``mkdocs build --strict`` still checks that each target exists."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

LINK = re.compile(r"(\]\()([^)\s#]+)((?:#[^)\s]*)?\))")
PREFIX = "_repo"
FENCE = re.compile(r"^(```|~~~)")


def _outside(src_uri: str, target: str) -> str | None:
    """The repository path ``target`` points at from the page ``src_uri``, when it lies
    outside docs/ (None for URLs, anchors and links inside docs/)."""
    if "://" in target or target.startswith(("mailto:", "/")):
        return None
    path = posixpath.normpath(posixpath.join("docs", posixpath.dirname(src_uri), target))
    return None if path.startswith("docs/") else path


def _links(markdown: str):
    fenced = False
    for line in markdown.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            yield from LINK.finditer(line)


def on_files(files, config):
    root = Path(config["config_file_path"]).parent
    wanted: set[str] = set()
    for f in files.documentation_pages():
        for m in _links(Path(f.abs_src_path).read_text(encoding="utf-8")):
            path = _outside(f.src_uri, m.group(2))
            if path and (root / path).is_file():
                wanted.add(path)
                if path.endswith(".md"):  # a results page shows its own plots
                    for m2 in _links((root / path).read_text(encoding="utf-8")):
                        sub = posixpath.normpath(posixpath.join(posixpath.dirname(path), m2.group(2)))
                        if (root / sub).is_file() and not sub.startswith(".."):
                            wanted.add(sub)
    for path in sorted(wanted):
        files.append(File.generated(config, f"{PREFIX}/{path}", abs_src_path=str(root / path)))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri.startswith(PREFIX + "/"):
        return markdown
    here = posixpath.dirname(page.file.src_uri)

    def move(m: re.Match) -> str:
        path = _outside(page.file.src_uri, m.group(2))
        if path is None:
            return m.group(0)
        return m.group(1) + posixpath.relpath(f"{PREFIX}/{path}", here or ".") + m.group(3)

    out, fenced = [], False
    for line in markdown.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        out.append(line if fenced else LINK.sub(move, line))
    return "\n".join(out)
