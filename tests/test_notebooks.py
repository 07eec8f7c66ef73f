"""Every notebook in notebooks/ runs top to bottom on the installed monarch kernel."""

from __future__ import annotations

import pathlib
import re

import nbformat
import pytest
from _kernels import Output
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def outputs(nb) -> str:
    """Every output of the executed notebook, one after another (as ``_kernels.Output`` reads them)."""
    found = (Output.from_notebook(node) for cell in nb.cells for node in cell.get("outputs", []))
    return "\n".join(o.text for o in found if o is not None)


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "training.ipynb"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, kernelspec):
    nb = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": str(path.parent)}}
    NotebookClient(nb, timeout=240, kernel_name=kernelspec, resources=resources).execute()
    text = outputs(nb)
    if path.stem == "quickstart":
        assert "[ranks 0-3] hello from the mesh" in text
        assert "read 4 MiB over shm: sum 549755289600" in text  # RDMABuffer, rank 0 -> rank 3
        assert "[rank 1] Traceback" in text and "ZeroDivisionError" in text
        assert "rank 3 died: exited with code 3" in text
        assert "dead (exited with code 3)" in text
        assert "restarted [rank 3] with fresh namespaces" in text and "[rank 3] 3" in text
    if path.stem == "training":
        losses = [float(m) for m in re.findall(r"\[ranks 0-3\] epoch \d: loss ([0-9.]+)", text)]
        assert len(losses) == 8 and losses[-1] < losses[0] / 5
        assert "[ranks 0-3] (2.54, 1.74)" in text
