"""Run a notebook headless on the monarch kernel and print each cell with its outputs
(`make demo` runs notebooks/quickstart.ipynb this way)."""

from __future__ import annotations

import re
import sys

import nbformat
from nbclient import NotebookClient

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def show(nb) -> None:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            print("\n" + "\n".join("# " + line for line in cell.source.splitlines()))
            continue
        print("\n" + "\n".join(">>> " + line for line in cell.source.splitlines()))
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                print(out.text, end="")
            elif out.output_type in ("execute_result", "display_data"):
                print(out.data.get("text/plain", ""))
            elif out.output_type == "error":
                print(ANSI.sub("", "\n".join(out.traceback)))


def main(path: str) -> int:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="monarch").execute()
    show(nb)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "notebooks/quickstart.ipynb"))
