"""The package's layers, checked from its source: lower layers never import upper ones, and
no package reaches into another's ``._private`` names (they meet through public methods and
the runtime's hooks).  Pure AST reading; nothing is imported or run."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parent.parent / "monarch_kernel"

# package -> the packages it may import (besides itself and the top-level re-exports' leaves)
ALLOWED = {
    "runtime": set(),
    "agent": {"runtime"},
    "actor": {"runtime", "mesh"},
    "mesh": {"runtime", "actor"},
    "data": {"runtime", "actor", "mesh"},
    "job": {"runtime", "actor", "mesh"},
    "spmd": {"runtime", "actor", "mesh", "data"},
    "debug": {"runtime", "actor", "mesh", "data"},
    "console": {"runtime", "actor", "mesh", "data", "debug"},
    "detached": {"runtime", "actor", "mesh", "data", "console", "job"},
    "kernel": {"runtime", "actor", "mesh", "data", "debug", "console", "detached", "job", "spmd"},
}
# The one way up, on purpose: Monarch puts setup_torch_distributed and device_mesh on ProcMesh,
# while their code (and torch) stays in spmd; the two methods import it when called.
UPWARD = {("mesh/proc_mesh.py", "spmd")}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        package = rel.parts[0] if len(rel.parts) > 1 else ""
        yield package, rel, ast.parse(path.read_text(), str(path))


def _imported_packages(rel: pathlib.Path, tree: ast.AST):
    """(line, package) for each import of another part of monarch_kernel."""
    here = list(rel.parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                target = base + (node.module.split(".") if node.module else [])
                if not target:  # "from .. import x": x is a package
                    for alias in node.names:
                        yield node.lineno, alias.name
                    continue
            elif node.module and node.module.startswith("monarch_kernel."):
                target = node.module.split(".")[1:]
            else:
                continue
            if target:
                yield node.lineno, target[0]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("monarch_kernel."):
                    yield node.lineno, alias.name.split(".")[1]


def test_lower_layers_never_import_upper_ones():
    bad = []
    for package, rel, tree in _modules():
        if package not in ALLOWED:
            continue
        for line, target in _imported_packages(rel, tree):
            if target != package and target in ALLOWED and target not in ALLOWED[package] \
                    and (rel.as_posix(), target) not in UPWARD:
                bad.append(f"{rel}:{line} ({package}) imports {target}")
    assert not bad, "imports that go up (or sideways) a layer:\n" + "\n".join(bad)


def _private_names_defined(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and _private(node.id):
            names.add(node.id)
        elif isinstance(node, ast.arg) and _private(node.arg):
            names.add(node.arg)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_package_reaches_into_another_packages_private_names():
    modules = list(_modules())
    defined: dict[str, set[str]] = {}
    for package, _rel, tree in modules:
        defined.setdefault(package, set()).update(_private_names_defined(tree))
    bad = []
    for package, rel, tree in modules:
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr in defined.get(package, set()):
                continue  # this package's own private name
            owners = [p for p, names in defined.items() if p != package and node.attr in names]
            if owners:
                bad.append(f"{rel}:{node.lineno} ({package or 'top'}) uses .{node.attr} of {', '.join(sorted(owners))}")
    assert not bad, "private names reached across packages:\n" + "\n".join(bad)


def test_the_layering_check_sees_a_violation(tmp_path):
    """The checks above can fail: a module that imports upward is caught."""
    tree = ast.parse("from ..kernel import magics\nfrom ..runtime.process import Runtime\n")
    found = [t for _l, t in _imported_packages(pathlib.Path("runtime/x.py"), tree)]
    assert found == ["kernel", "runtime"]


TORCHRUN_VARIABLES = re.compile(r"\b(RANK|LOCAL_RANK|GROUP_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT)\b")


def test_the_runtime_never_names_torchruns_variables():
    """torch.distributed's environment is spmd's business (it sets it when it makes a process
    group or runs a script); a plain rank's runtime knows nothing of it."""
    bad = []
    for package, rel, tree in _modules():
        if package != "runtime":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and TORCHRUN_VARIABLES.search(node.value):
                bad.append(f"{rel}:{node.lineno} names {TORCHRUN_VARIABLES.search(node.value).group(0)}")
            elif isinstance(node, (ast.Attribute, ast.Name, ast.arg)) and "master_port" in str(
                    getattr(node, "attr", None) or getattr(node, "id", None) or getattr(node, "arg", "")):
                bad.append(f"{rel}:{node.lineno} names master_port")
    assert not bad, "runtime/ names torchrun's variables (set them in spmd/):\n" + "\n".join(bad)
