"""Notebooks the test suite has just run: the build shows their outputs instead of running them
a second time.  ``make test`` runs notebooks/ once (tests/system/test_notebooks.py, in a fresh
``make setup`` copy), then builds the site on the same worker (tests/docs/test_site.py) with
``MONARCH_KERNEL_DOCS_EXECUTED`` naming the folder where that test kept each notebook it ran
clean.  It must never show outputs of other cells than the source's, nor let an error pass.

A notebook of the site whose file name is in that folder, with the same cells (types and
sources) as the site's copy, is read from there with myst-nb's execution off for it (its
notebook-level ``mystnb: execution_mode``); an error output of a cell not tagged
``raises-exception`` is a warning (an error under ``-W``), as myst-nb's own run reports one.
Any other notebook, and every notebook when the variable is unset (``make docs``), runs as
``nb_execution_mode`` says.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx
from sphinx.util import logging

ENV = "MONARCH_KERNEL_DOCS_EXECUTED"
logger = logging.getLogger(__name__)


def _text(source: str | list[str]) -> str:
    return "".join(source) if isinstance(source, list) else source


def cells(nb: dict[str, Any]) -> list[tuple[str, str]]:
    """What a notebook says, outputs aside: each cell's type and source."""
    return [(cell["cell_type"], _text(cell["source"])) for cell in nb["cells"]]


def errors(nb: dict[str, Any]) -> list[str]:
    """The error outputs of the cells not tagged ``raises-exception``, each with its traceback."""
    found = []
    for n, cell in enumerate(nb["cells"]):
        if "raises-exception" in cell.get("metadata", {}).get("tags", []):
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                trace = "\n".join(out.get("traceback", []))
                found.append(f"cell {n + 1} raised {out.get('ename')}: {out.get('evalue')}\n{trace}")
    return found


def executed_source(docname: str, source: str, path: Path, folder: Path, metadata_key: str) -> str | None:
    """The executed notebook's JSON to read in place of ``source``, execution off; ``None`` to
    run ``source`` instead (no such notebook in ``folder``, or its cells are not the source's)."""
    executed = folder / path.name
    if path.suffix != ".ipynb" or not executed.is_file():
        return None
    nb = json.loads(executed.read_text(encoding="utf-8"))
    if cells(nb) != cells(json.loads(source)):
        logger.info("%s: %s has other cells than %s: it runs", docname, executed, path)
        return None
    for problem in errors(nb):
        logger.warning("%s: the executed notebook %s has an error output: %s", docname, executed, problem,
                       location=docname)
    nb.setdefault("metadata", {}).setdefault(metadata_key, {})["execution_mode"] = "off"
    logger.info("%s: the outputs of %s", docname, executed)
    return json.dumps(nb)


def _source_read(app: Sphinx, docname: str, source: list[str]) -> None:
    folder = os.environ.get(ENV)
    if not folder:
        return
    taken = executed_source(docname, source[0], Path(app.env.doc2path(docname)), Path(folder),
                            app.config.nb_metadata_key)
    if taken is not None:
        source[0] = taken


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("myst_nb")
    app.connect("source-read", _source_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
