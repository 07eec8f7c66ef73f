"""``lazy_names``: a package's names, written once as the imports under its ``if
TYPE_CHECKING:`` block, each loaded when first asked for (PEP 562).  Type checkers read the
names there; importing the package loads none of their modules.  The runtime's two doors, the
public API (``monarch_kernel``) and the history package load their names so.
"""

from __future__ import annotations

from typing import Any


def lazy_names(door: str, path: str) -> tuple[Any, Any]:
    """``(__getattr__, __dir__)`` for the door module ``door`` (its ``__name__``) whose source
    is ``path``: the names its ``if TYPE_CHECKING:`` block imports, each loaded on first use.
    ``__all__`` is asked of ``__getattr__`` too.  (scientific Python's ``lazy_loader`` reads a
    stub file the same way.)"""
    table: dict[str, tuple[str, str]] = {}  # name -> (module to import from, its name there)

    def read() -> dict[str, tuple[str, str]]:
        if not table:
            import ast
            import importlib.util

            with open(path, encoding="utf-8") as f:
                source = f.read()
            for block in ast.parse(source).body:
                if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING":
                    for node in block.body:
                        assert isinstance(node, ast.ImportFrom), f"{path}: only 'from . import' lines in the door"
                        here = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                        table.update({a.asname or a.name: (here, a.name) for a in node.names})
        return table

    package = door if path.endswith("__init__.py") else door.rpartition(".")[0]

    def __getattr__(name: str) -> Any:
        import importlib
        import sys

        if name == "__all__":
            return sorted(read())
        if name not in read():
            raise AttributeError(f"module {door!r} has no attribute {name!r}")
        where, there = table[name]
        if where == door:  # a module of this package: ``from . import config``
            value: Any = importlib.import_module(f"{where}.{there}")
        else:  # as ``from where import there`` would: a name of that module, else its submodule
            module = importlib.import_module(where)
            value = getattr(module, there) if hasattr(module, there) else importlib.import_module(f"{where}.{there}")
        setattr(sys.modules[door], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(read())

    return __getattr__, __dir__
