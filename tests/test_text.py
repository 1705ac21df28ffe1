"""The package's text stays light (issue 44): module docstrings of at most 25 lines, fewer than
60 ``# fmt: skip`` markers, no line numbers of other projects' files in a docstring."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import mcore_npu

PACKAGE = Path(mcore_npu.__file__).resolve().parent
SOURCES = sorted(PACKAGE.rglob("*.py"))
# "megatron/core/.../foo.py:123" or "foo.py line 123": a line of someone else's file
FOREIGN_LINE = re.compile(r"\b[\w/]+\.py(:\d+| lines? \d+)")


def test_module_docstrings_are_at_most_25_lines():
    long = {}
    for path in SOURCES:
        text = ast.get_docstring(ast.parse(path.read_text()), clean=False) or ""
        if text.count("\n") + 1 > 25:
            long[str(path.relative_to(PACKAGE))] = text.count("\n") + 1
    assert not long, f"module docstrings over 25 lines (move the narrative to docs/): {long}"


def test_fewer_than_60_fmt_skips():
    counts = {p.relative_to(PACKAGE): p.read_text().count("# fmt: skip") for p in SOURCES}
    total = sum(counts.values())
    worst = sorted(counts.items(), key=lambda item: -item[1])[:5]
    assert total < 60, f"{total} '# fmt: skip' in the package; keep them for tables: {worst}"


def test_no_docstring_cites_a_line_of_another_file():
    cited = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                text = ast.get_docstring(node, clean=False) or ""
                cited += [f"{path.name}: {m.group(0)}" for m in FOREIGN_LINE.finditer(text)]
    assert not cited, cited
