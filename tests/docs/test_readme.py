"""The README is a front page: at most 150 lines, the two commands first and unchanged, no issue
numbers and no history of figures (that is CHANGELOG.md's), and every relative link it makes
(into docs/, which any git host renders) names a file of this tree."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)
ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
TWO_COMMANDS = """```bash
make lab    # sets up .venv (CPU torch 2.13.0, the project, its kernelspec, the panel) and starts JupyterLab
make test   # same set-up plus what only the tests need, then the whole test suite
```"""


def test_the_readme_is_a_front_page():
    assert len(README.splitlines()) <= 150, f"README.md has {len(README.splitlines())} lines; the docs take the rest"
    assert README.index("```") == README.index(TWO_COMMANDS), "the two commands are the README's first code"
    assert not re.search(r"\bissues? \d+|#\d+\b", README), "issue numbers belong to the changelog, not the README"
    assert not re.search(r"\bbefore(:| the native)", README), "the history of figures belongs to CHANGELOG.md"


def test_every_relative_link_of_the_readme_names_a_file():
    links = [target for target in re.findall(r"\]\(([^)\s]+)\)", README) if "://" not in target]
    assert "docs/index.md" in links and "docs/get-started.md" in links, links
    missing = [t for t in links if not (ROOT / t.partition("#")[0]).exists()]
    assert not missing, f"README.md links to files that are not there: {missing}"
