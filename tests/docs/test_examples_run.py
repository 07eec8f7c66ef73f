"""Every Python example in the docs' pages runs at build time (issue 47, point 2): a page's
Python block is a MyST-NB ``{code-cell}``, executed by the build on the monarch kernel, unless
the line above it says why it is shown and not run (``<!-- not run: ... -->``: hosts or
hardware that are not here, with a recorded run beside it, or a signature).  The recorded
runs themselves (``docs/_recorded/``) say where and when they ran, and are checked there."""

from __future__ import annotations

import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
PYTHON_FENCE = re.compile(r"^```(python|python3|py|ipython|ipython3|pycon)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: \S.*-->$")

pytestmark = pytest.mark.timeout(60)


def pages() -> list[pathlib.Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts and "_recorded" not in p.parts)


def test_recorded_runs_say_where_and_when_they_ran():
    for page in sorted((DOCS / "_recorded").glob("*.md")):
        text = page.read_text(encoding="utf-8")
        assert re.search(r"^:::\{admonition\} Recorded \d{4}-\d\d-\d\d \d\d:\d\d UTC on ", text, re.M), page
        assert "Not run when this site is built" in text, page


def test_every_python_block_is_run_or_says_why_not():
    shown = []
    for page in pages():
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if PYTHON_FENCE.match(line) and not (i and NOT_RUN.match(lines[i - 1])):
                shown.append(f"{page.relative_to(DOCS)}:{i + 1}")
    assert not shown, ("Python blocks the build does not run: make each a ```{code-cell} ipython3 (the page "
                       "needs MyST-NB's front matter), or say above it <!-- not run: why -->: " + ", ".join(shown))


def test_pages_with_code_cells_are_executed_on_the_monarch_kernel():
    for page in pages():
        text = page.read_text(encoding="utf-8")
        if "```{code-cell}" in text:
            head = text.split("\n---\n", 1)[0]
            assert text.startswith("---\n") and "file_format: mystnb" in head and "name: monarch" in head, page
