"""Griffe extension: the docstrings use Sphinx roles (``:class:`~a.b.C```, ``:func:`f```);
Markdown has none, so each becomes a code span (the last name only after ``~``); a reST
``text::`` before an indented literal block becomes ``text:`` (the indented block is already
Markdown's code block)."""

from __future__ import annotations

import re

import griffe

LITERAL = re.compile(r"(^|\S)::[ \t]*$", re.M)  # reST's "text::" before a literal block
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj|const):`(~?)([^`]+)`")


def _plain(m: re.Match) -> str:
    name = m.group(2)
    return f"`{name.rsplit('.', 1)[-1] if m.group(1) else name}`"


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            text = ROLE.sub(_plain, obj.docstring.value)
            obj.docstring.value = LITERAL.sub(lambda m: m.group(1) + (":" if m.group(1) else ""), text)
