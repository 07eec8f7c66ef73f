"""Every notebook in notebooks/ runs top to bottom on the installed monarch kernel."""

from __future__ import annotations

import pathlib
import re

import nbformat
import pytest
from _kernels import ensure_kernelspec
from nbclient import NotebookClient

from monarch_kernel.kernel.kernelspec import KERNEL_NAME

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def outputs(nb) -> str:
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                text.append(out.text)
            elif out.output_type in ("execute_result", "display_data"):
                text.append(out.data.get("text/plain", ""))
            elif out.output_type == "error":
                text.append(ANSI.sub("", "\n".join(out.traceback)))
    return "\n".join(text)


@pytest.fixture(scope="module", autouse=True)
def kernelspec():
    ensure_kernelspec()


def test_there_are_notebooks():
    assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "training.ipynb"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=240, kernel_name=KERNEL_NAME, resources={"metadata": {"path": str(path.parent)}}).execute()
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
