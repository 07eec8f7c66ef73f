"""The documentation site (``make docs``): Sphinx with MyST Markdown and myst-nb.

Strict on purpose: ``-W`` turns every warning into an error, ``nitpicky`` checks every
cross-reference, and every notebook and every guide's code cell runs on the monarch kernel
at each build (a failing cell fails the build).  Nothing here reaches the internet.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path[:0] = [str(DOCS / "_ext"), str(ROOT), str(ROOT / "extension")]
# What the executed pages leave (their meshes' histories, hang reports, debug sessions) goes
# under the build's folder, never into the builder's ~/.local/state: the kernels it starts inherit it.
os.environ["XDG_STATE_HOME"] = str(DOCS / "_build" / "state")

project = "monarch-kernel"
author = "the monarch-kernel authors"
copyright = "the monarch-kernel authors"  # noqa: A001  (Sphinx's name)

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx_click",
    "mk_generated",
    "mk_executed",  # the suite's build takes the notebooks tests/system/test_notebooks.py just ran
]

templates_path = ["_templates"]
# _recorded/: outputs recorded on simulated hosts (its record.py), included by the guides that show them
exclude_patterns = ["_build", "_templates", "_recorded", "**.ipynb_checkpoints", "Thumbs.db", ".DS_Store"]
html_theme = "pydata_sphinx_theme"
html_title = "monarch-kernel"
html_static_path: list[str] = []
html_theme_options = {"navigation_with_keys": False, "show_toc_level": 2, "secondary_sidebar_items": ["page-toc"]}
html_show_sourcelink = False

# MyST: fenced ```python blocks are plain code; ```{code-cell} blocks (pages with a kernelspec in
# their front matter) run on the kernel.  Headings get anchors so pages link to sections.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# Every notebook and every text notebook runs at each build, on the kernel its metadata names (the
# monarch kernel), each in a fresh temporary folder; a cell that raises fails the build unless
# it is tagged ``raises-exception``: a warning with the cell's traceback, which -W makes an error
# (raising at once instead would hide the traceback in a crash report).
# (The suite's build, tests/docs/test_site.py, reads the notebooks that tests/system/test_notebooks.py
# ran just before it instead, errors checked the same way: _ext/mk_executed.py.)
nb_execution_mode = "force"
nb_execution_timeout = 300
nb_execution_raise_on_error = False
nb_execution_show_tb = True
nb_execution_in_temp = True
nb_merge_streams = True

# The API reference: autosummary writes a page per public name (reference/_api/, not tracked).
autosummary_generate = ["reference/api.md"]
autosummary_imported_members = True
autosummary_ignore_module_all = False  # a module page (history) lists its __all__, not every import
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_member_order = "bysource"
autodoc_default_options = {"members": True, "show-inheritance": False}

nitpicky = True
# Names of libraries whose own documentation is not here (no intersphinx: no internet), and
# typing's internals that Sphinx cannot link.  The project's own names are all checked.
nitpick_ignore_regex = [
    # type variables of generic classes (Future[R], ValueMesh[R]): no page of their own
    (r"py:(class|obj)", r"(monarch_kernel\..*\.)?_?[A-Z]"),
    (r"py:(class|obj)", r"monarch_kernel\..*\._S"),
    # constructor arguments only the runtime passes (a Future's completion, a mesh's reference, a
    # stream's decoder of answers)
    (r"py:class", r"(monarch_kernel\.runtime\..*\.)?(Completion|MeshRef|Part)"),
    # the quoted annotation of a dataclass field whose default is a factory (RankProfile.ops):
    # autodoc reads the generated __init__'s string annotation, quotes and all
    (r"py:class", r"'dict\[str"),
    (r"py:.*", r"(torch|zmq|numpy|np|IPython|ipykernel|jupyter_client|traitlets|tornado|asyncio|concurrent|"
               r"collections|typing|typing_extensions|types|contextvars|logging|pathlib|socket|subprocess|"
               r"threading|queue|weakref|enum|dataclasses|os|io|abc|collections\.abc)(\..*)?"),
    (r"py:class", r"(Any|Callable|Iterable|Iterator|Mapping|Sequence|Awaitable|Coroutine|Generator|AsyncIterator|"
                  r"Generic|Protocol|TypeVar|ParamSpec|Self|T|R|P|_T|NoneType|Ellipsis|EllipsisType|"
                  r"int|float|str|bytes|bool|dict|list|tuple|set|frozenset|object|type|memoryview|bytearray|"
                  r"Exception|BaseException|RuntimeError|ValueError|TimeoutError|KeyError|OSError)"),
]

