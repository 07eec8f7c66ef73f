"""The docs build takes a notebook the suite already ran (docs/_ext/mk_executed.py): its outputs,
with nothing run again, only when its cells are the site's; an error output in it fails the
build as a run's error does; without the folder, or for other cells, the notebook runs.  Each
case is a real Sphinx build (-W) of a one-notebook site on the ``python3`` kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

EXT = Path(__file__).resolve().parents[2] / "docs" / "_ext"
pytestmark = pytest.mark.timeout(300)

CONF = f"""
import sys
sys.path.insert(0, {str(EXT)!r})
extensions = ["myst_nb", "mk_executed"]
exclude_patterns = ["_build"]
nb_execution_mode = "force"
nb_execution_raise_on_error = False
nb_execution_show_tb = True
"""
SOURCE = 'print("ran here:", 6 * 7)'
RAN = "ran here: 42"  # only in an output: the source is highlighted, word by word


def notebook(source: str, outputs: list | None = None, tags: list[str] | None = None) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source, outputs=outputs or [], metadata={"tags": tags} if tags else {})
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Page"), cell])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def printed(text: str) -> dict:
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def build(tmp_path: Path, executed: nbformat.NotebookNode | None, *, folder: bool = True):
    """Build the site (``page.ipynb`` holds ``SOURCE``) with ``executed`` kept for it; the
    build's result and the page's text."""
    src, kept, out = tmp_path / "src", tmp_path / "kept", tmp_path / "html"
    src.mkdir()
    kept.mkdir()
    (src / "conf.py").write_text(CONF)
    (src / "index.md").write_text("# Site\n\n```{toctree}\npage\n```\n")
    nbformat.write(notebook(SOURCE), src / "page.ipynb")
    if executed is not None:
        nbformat.write(executed, kept / "page.ipynb")
    env = {k: v for k, v in os.environ.items() if k != "MONARCH_KERNEL_DOCS_EXECUTED"}
    if folder:
        env["MONARCH_KERNEL_DOCS_EXECUTED"] = str(kept)
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(src), str(out),
                           "-d", str(tmp_path / "doctrees")], capture_output=True, text=True, timeout=240, env=env)
    page = out / "page.html"
    return done, page.read_text() if page.exists() else ""


def test_the_kept_outputs_are_shown_and_nothing_runs(tmp_path):
    done, page = build(tmp_path, notebook(SOURCE, [printed("recorded by the suite\n")]))
    assert done.returncode == 0, done.stderr
    assert "recorded by the suite" in page and RAN not in page


def test_an_error_output_fails_the_build(tmp_path):
    error = nbformat.v4.new_output("error", ename="ValueError", evalue="boom",
                                   traceback=["Traceback", "ValueError: boom"])
    done, _ = build(tmp_path, notebook(SOURCE, [error]))
    assert done.returncode != 0
    assert "has an error output: cell 2 raised ValueError: boom" in done.stderr, done.stderr


def test_an_error_in_a_cell_tagged_raises_exception_is_shown(tmp_path):
    error = nbformat.v4.new_output("error", ename="ValueError", evalue="boom", traceback=["ValueError: boom"])
    done, page = build(tmp_path, notebook(SOURCE, [error], tags=["raises-exception"]))
    assert done.returncode == 0, done.stderr
    assert "boom" in page


def test_a_notebook_with_other_cells_runs(tmp_path):
    done, page = build(tmp_path, notebook('print("ran here:", 6 * 8)', [printed("recorded by the suite\n")]))
    assert done.returncode == 0, done.stderr
    assert RAN in page and "recorded by the suite" not in page


def test_without_the_folder_every_notebook_runs(tmp_path):
    done, page = build(tmp_path, notebook(SOURCE, [printed("recorded by the suite\n")]), folder=False)
    assert done.returncode == 0, done.stderr
    assert RAN in page and "recorded by the suite" not in page
    assert json.loads((tmp_path / "src" / "page.ipynb").read_text())["cells"][1]["outputs"] == []


@pytest.mark.parametrize("worker", [None, "gw0"], ids=["serial", "xdist-worker"])
def test_the_notebooks_tests_come_right_before_the_sites(worker, tmp_path):
    """conftest.py's order, serial and on an xdist worker: test_notebooks, then test_site at once
    (one unit of work: one worker runs both, in that order)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env["TMPDIR"] = str(tmp_path)  # what conftest makes at import (its user folders) goes there
    if worker:
        env["PYTEST_XDIST_WORKER"] = worker
    listed = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
                             "tests/docs", "tests/system/test_notebooks.py"], cwd=root, env=env,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stdout + listed.stderr
    modules = [line.partition("::")[0].rpartition("/")[2] for line in listed.stdout.splitlines() if "::" in line]
    runs = [m for n, m in enumerate(modules) if n == 0 or modules[n - 1] != m]  # each module once, in order
    at = runs.index("test_notebooks.py")
    assert runs[at + 1] == "test_site.py", runs
