"""The package's layers, checked from its source: lower layers never import upper ones, and
no package reaches into another's ``._private`` names (they meet through public methods and
the runtime's hooks), and layers above runtime/ come in by its two doors and reach none of
its parts; and the tests' own: no test module is imported (what tests share is in
tests/support/).  AST reading, but for the runtime's two doors' name lists, which importing
the doors gives (and which loads none of runtime/'s modules)."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[2] / "monarch_kernel"

# package -> the packages it may import (besides itself and the top-level re-exports' leaves).
# Actors and meshes are one layer (``actor/``, as Monarch's ``_src/actor/``); looking at ranks
# (``observe/``: stacks, metrics) sits between the runtime and that layer, distributed tensors
# above it (the actor layer reaches them only through ``actor/tensor_shim.py``); no two
# packages may import each other (``test_no_two_packages_may_import_each_other``).
ALLOWED = {
    "runtime": set(),
    "agent": {"runtime", "history"},
    "observe": {"runtime"},
    "history": {"runtime"},
    "actor": {"runtime", "observe", "history"},
    "tensors": {"runtime", "actor"},
    "data": {"runtime", "actor"},
    "job": {"runtime", "actor", "agent", "history"},  # agent/: the worker's wire and key, which the job speaks too
    "spmd": {"runtime", "actor", "data"},
    "debug": {"runtime", "actor", "data"},
    "console": {"runtime", "actor", "data", "debug"},
    "detached": {"runtime", "observe", "actor", "data", "console", "job", "history"},
    "kernel": {"runtime", "observe", "history", "actor", "data", "debug", "console", "detached", "job", "spmd",
               "tensors", "agent"},
    # the command line: a thin face on the public API, the records and %mesh's help
    "cli": {"runtime", "observe", "history", "actor", "detached", "job", "kernel"},
}
# Packages that hold both halves of a feature, in folders by the process that runs them: what
# runs on a rank never imports what runs in the controller (the kernel, or a script).
HALVES = {"debug": ("rank", "controller"), "spmd": ("rank", "controller"), "tensors": ("rank", "controller")}
# torchrun's variables: only spmd/ sets them, when it makes a group or runs a script.
TORCH_VARIABLES = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
}
MAX_LINES = 450
MAX_METHODS = 30


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        package = rel.parts[0] if len(rel.parts) > 1 else ""
        yield package, rel, ast.parse(path.read_text(), str(path))


def _imported_modules(rel: pathlib.Path, tree: ast.AST):
    """(line, dotted path under monarch_kernel) of each module-level or inner import."""
    here = list(rel.parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                target = base + (node.module.split(".") if node.module else [])
                names = [target + [a.name] for a in node.names]
            elif node.module and node.module.startswith("monarch_kernel."):
                names = [node.module.split(".")[1:] + [a.name] for a in node.names]
            else:
                continue
            for name in names:
                yield node.lineno, name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("monarch_kernel."):
                    yield node.lineno, alias.name.split(".")[1:]


def _imported_packages(rel: pathlib.Path, tree: ast.AST):
    """(line, package) for each import of another part of monarch_kernel."""
    seen = set()
    for line, module in _imported_modules(rel, tree):
        if (line, module[0]) not in seen:
            seen.add((line, module[0]))
            yield line, module[0]


def test_lower_layers_never_import_upper_ones():
    bad = []
    for package, rel, tree in _modules():
        if package not in ALLOWED:
            continue
        for line, target in _imported_packages(rel, tree):
            if target != package and target in ALLOWED and target not in ALLOWED[package]:
                bad.append(f"{rel}:{line} ({package}) imports {target}")
    assert not bad, "imports that go up (or sideways) a layer:\n" + "\n".join(bad)


def test_no_two_packages_may_import_each_other():
    both = sorted(f"{a} <-> {b}" for a, allowed in ALLOWED.items() for b in allowed
                  if a < b and a in ALLOWED.get(b, set()))
    assert not both, "pairs of packages allowed to import each other (one must be the lower layer):\n" + \
        "\n".join(both)


def _rooms_importing_each_other(modules) -> list[str]:
    """Pairs of runtime/'s rooms (its sub-packages) that import each other, lazy and
    type-only imports included, each with the first place of each direction."""
    modules = list(modules)
    rooms = {rel.parts[1] for package, rel, _tree in modules if package == "runtime" and len(rel.parts) > 2}
    first: dict[tuple[str, str], str] = {}
    for package, rel, tree in modules:
        if package != "runtime" or len(rel.parts) < 3:
            continue
        for line, target in _imported_modules(rel, tree):
            if len(target) > 2 and target[0] == "runtime" and target[1] in rooms and target[1] != rel.parts[1]:
                first.setdefault((rel.parts[1], target[1]), f"{rel}:{line}")
    return sorted(f"{a} <-> {b} ({first[a, b]}, {first[b, a]})" for a, b in first if a < b and (b, a) in first)


def test_no_two_rooms_of_the_runtime_import_each_other():
    """runtime/'s rooms (wire/, net/, spawn/, calls/) stand on each other one way only, as
    runtime/__init__.py draws them."""
    both = _rooms_importing_each_other(_modules())
    assert not both, "rooms of runtime/ that import each other (one must be the lower):\n" + "\n".join(both)


def test_the_rooms_check_sees_two_rooms_importing_each_other():
    planted = [("runtime", pathlib.Path(path), ast.parse(source)) for path, source in [
        ("runtime/wire/a.py", "from ..net.inbox import Inbox\n"),
        ("runtime/net/b.py", "def f():\n    from ..wire import envelope\n"),
        ("runtime/spawn/c.py", "from ..wire.envelope import Part\nfrom .. import config\n"),
        ("runtime/process.py", "from .net import inbox\nfrom .wire import envelope\n")]]
    assert _rooms_importing_each_other(planted) == ["net <-> wire (runtime/net/b.py:2, runtime/wire/a.py:1)"]


def test_what_runs_on_ranks_never_imports_what_runs_in_the_controller():
    bad = []
    for package, rel, tree in _modules():
        if package not in HALVES or len(rel.parts) < 3 or rel.parts[1] != HALVES[package][0]:
            continue
        for line, target in _imported_modules(rel, tree):
            if target[:2] == [package, HALVES[package][1]]:
                bad.append(f"{rel}:{line} imports {'.'.join(target)}")
    assert not bad, "rank-side modules importing controller-side ones:\n" + "\n".join(bad)


def test_the_actor_layer_names_the_tensors_package_only_in_its_shim():
    """actor/ imports no tensors module (``ALLOWED``), and names none in a string either (a
    ``sys.modules`` look-up, an ``importlib`` call) but in ``tensor_shim.py``, the one way up."""
    bad = []
    for package, rel, tree in _modules():
        if package != "actor" or rel.name == "tensor_shim.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "tensors." in node.value:
                bad.append(f"{rel}:{node.lineno} names {node.value!r}")
    assert not bad, "actor/ reaching the tensors package other than through tensor_shim.py:\n" + "\n".join(bad)


def test_no_module_is_over_450_lines():
    bad = []
    for _package, rel, _tree in _modules():
        lines = len((ROOT / rel).read_text().splitlines())
        if lines > MAX_LINES:
            bad.append(f"{rel}: {lines} lines")
    assert not bad, f"modules over {MAX_LINES} lines (split them by concept):\n" + "\n".join(bad)


def test_no_class_has_over_30_methods():
    bad = []
    for _package, rel, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                if methods > MAX_METHODS:
                    bad.append(f"{rel}:{node.lineno} {node.name}: {methods} methods")
    assert not bad, f"classes over {MAX_METHODS} methods (split them by what they do):\n" + "\n".join(bad)


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
    # a rank-side module importing the controller's half, two ways
    tree = ast.parse("from ..controller.tunnel import TunnelConnection\nfrom ..controller import proxy\n")
    found = [m for _l, m in _imported_modules(pathlib.Path("debug/rank/x.py"), tree)]
    assert found == [["debug", "controller", "tunnel", "TunnelConnection"], ["debug", "controller", "proxy"]]


# The runtime's parts, which layers above it reach only through ``Runtime``'s methods
# (runtime/front_door.py, runtime/local_door.py): they may change behind them.  Every attribute
# that ``Runtime`` sets on itself (runtime/process.py) is a part, but these: ``rt.io`` and
# ``rt.hooks`` (surfaces of their own) and what this process is (its key, run directory, host,
# address, owner, own mesh, ports published to its job, whether it is closed or serves actors).
NOT_PARTS = {"io", "hooks", "key", "rundir", "host", "address", "owner", "self_mesh", "job_ports", "owns_rundir",
             "closed", "serves_actors"}
RUNTIME_NAMES = {"rt", "_rt", "runtime"}


def _runtime_parts(tree: ast.AST) -> set[str]:
    """The public attributes ``Runtime`` sets on ``self`` in process.py, less ``NOT_PARTS``."""
    runtime = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Runtime")
    targets = [t for n in ast.walk(runtime) if isinstance(n, (ast.Assign, ast.AnnAssign))
               for t in (n.targets if isinstance(n, ast.Assign) else [n.target])]
    return {x.attr for t in targets for x in ast.walk(t) if isinstance(x, ast.Attribute)
            and isinstance(x.value, ast.Name) and x.value.id == "self" and not _private(x.attr)} - NOT_PARTS


RUNTIME_PARTS = _runtime_parts(ast.parse((ROOT / "runtime" / "process.py").read_text()))


def _is_runtime(node: ast.AST) -> bool:
    """``rt``, ``self.rt``, ``self._rt``, ``Runtime.current()`` or ``Runtime.existing()``."""
    if isinstance(node, ast.Name):
        return node.id in RUNTIME_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr in RUNTIME_NAMES and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in
            ("current", "existing") and isinstance(node.func.value, ast.Name) and node.func.value.id == "Runtime")


def _part_reach_ins(rel, tree: ast.AST) -> list[str]:
    return [f"{rel}:{node.lineno} names .{node.attr} of the runtime" for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in RUNTIME_PARTS and _is_runtime(node.value)]


def test_upper_layers_use_the_runtime_through_its_front_door():
    """Above runtime/, nobody names ``rt.launcher``, ``rt.caller``...: they call the methods
    of ``Runtime`` (runtime/front_door.py), so the parts can change behind them."""
    bad = []
    for package, rel, tree in _modules():
        if package != "runtime":
            bad += _part_reach_ins(rel, tree)
    for path in sorted((ROOT.parent / "extension").rglob("*.py")):
        bad += _part_reach_ins(path.relative_to(ROOT.parent), ast.parse(path.read_text(), str(path)))
    assert not bad, "reach-ins past the runtime's front door (add a method to runtime/front_door.py):\n" + \
        "\n".join(bad)


def test_the_front_door_check_sees_a_reach_in():
    tree = ast.parse("rt.launcher.kill(om, [0])\nRuntime.current().caller.send_port(a, 1, p)\n"
                     "self.rt.network.net_address\nself._rt.meshes.get(m)\nRuntime.existing().transport\n"
                     "rt.io.call_soon(f)\nrt.hooks.output\nrt.listen(ip)\njob.meshes\n"
                     "rt.receiver.wait(c, 1)\nself._rt.ports.close(p)\nrt.segments.track()\n"
                     "rt.open_port(f, once=True)\n")
    found = sorted(int(line.split(":")[1].split()[0]) for line in _part_reach_ins("x.py", tree))
    assert found == [1, 2, 3, 4, 5, 10, 11, 12]


def test_every_part_of_the_runtime_is_a_part():
    """The parts are read from process.py, so a new part is one at once; the three that were
    once reached from above are among them."""
    assert {"launcher", "caller", "outbox", "server", "supervision", "meshes", "network", "transport",
            "receiver", "ports", "segments", "signer", "inbox", "memberships"} <= RUNTIME_PARTS
    planted = ast.parse("class Runtime:\n    def __init__(self):\n        self.io = IOThread()\n"
                        "        self.tables: dict = {}\n        self.a, self.b = A(), B()\n        self._c = 1\n"
                        "        self.key = k\n")
    assert _runtime_parts(planted) == {"tables", "a", "b"}


TORCHRUN_VARIABLES = re.compile(r"\b(" + "|".join(sorted(TORCH_VARIABLES)) + r")\b")


def test_the_runtime_never_names_torchruns_variables():
    """torch.distributed's environment is spmd's business (it sets it when it makes a process
    group or runs a script); a plain rank's runtime knows nothing of it, and the tensor
    engine makes its groups over a store it is given."""
    bad = []
    for package, rel, tree in _modules():
        if package not in ("runtime", "tensors"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and TORCHRUN_VARIABLES.search(node.value):
                bad.append(f"{rel}:{node.lineno} names {TORCHRUN_VARIABLES.search(node.value).group(0)}")
            elif isinstance(node, (ast.Attribute, ast.Name, ast.arg)) and "master_port" in str(
                    getattr(node, "attr", None) or getattr(node, "id", None) or getattr(node, "arg", "")):
                bad.append(f"{rel}:{node.lineno} names master_port")
    assert not bad, "runtime/ or tensors/ names torchrun's variables (set them in spmd/):\n" + "\n".join(bad)


# runtime/'s two doors, each a module whose ``__all__`` is what it hands on: the main door (the
# package) for every layer above runtime/ but these, and the hosting door for agents and jobs.
# (runtime/__init__.py says how each door's names are written once.)
HOSTING = {"agent", "job", "history"}
DOORS = {"main": ["runtime"], "hosting": ["runtime", "hosting"]}


def _door_names() -> dict[str, set[str]]:
    """Each door's ``__all__`` (importing a door loads none of runtime/'s modules)."""
    import monarch_kernel.runtime
    import monarch_kernel.runtime.hosting

    return {"main": set(monarch_kernel.runtime.__all__), "hosting": set(monarch_kernel.runtime.hosting.__all__)}


def _past_the_doors(rel: pathlib.Path, tree: ast.AST, names: dict[str, set[str]]) -> list[str]:
    """Imports of runtime/ that do not go through the door this module's package comes in by
    (``hosting`` for agent/ and job/, else ``main``): of a module under runtime/ other than the
    door (``from ..runtime.process import Runtime``, ``import monarch_kernel.runtime.wire``),
    of the other door, or of a name its door does not hand on (``from ..runtime import
    launcher`` loads that module).  Lazy imports in functions and ``TYPE_CHECKING`` ones count."""
    here = list(rel.parts[:-1])
    door = "hosting" if rel.parts[0] in HOSTING else "main"
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)] if node.level > 1 else here
                module = base + (node.module.split(".") if node.module else [])
            elif node.module and (node.module + ".").startswith("monarch_kernel."):
                module = node.module.split(".")[1:]
            else:
                continue
            if module[:1] != ["runtime"]:
                continue
            imported = [a.name for a in node.names]
            if module != DOORS[door] or any(n not in names[door] for n in imported):
                where = ".".join(["monarch_kernel", *module])
                bad.append(f"{rel}:{node.lineno} from {where} import {', '.join(imported)} "
                           f"(by the {door} door: from {'.'.join(['monarch_kernel', *DOORS[door]])} import ...)")
        elif isinstance(node, ast.Import):
            bad += [f"{rel}:{node.lineno} import {a.name}" for a in node.names
                    if a.name.startswith("monarch_kernel.runtime.")]
    return bad


def test_upper_layers_import_the_runtime_only_through_its_doors():
    """Above runtime/, agent/ and job/ import ``from ..runtime.hosting import X``, every other
    layer ``from ..runtime import X``, X in that door's ``__all__``; never a module under
    runtime/, nor the other door: the rooms can be rearranged behind the doors, and a layer that
    only uses meshes never sees templates and host links.  Tests may import deep modules."""
    names = _door_names()
    bad = []
    for package, rel, tree in _modules():
        if package != "runtime":
            bad += _past_the_doors(rel, tree, names)
    for path in sorted((ROOT.parent / "extension").rglob("*.py")):
        bad += _past_the_doors(path.relative_to(ROOT.parent), ast.parse(path.read_text(), str(path)), names)
    assert not bad, ("imports past the runtime's doors (import the name from its door, adding it to the "
                     "door's TYPE_CHECKING imports if the layers above may use it):\n" + "\n".join(bad))


def test_the_door_import_check_sees_each_way_past_it():
    tree = ast.parse("from ..runtime.process import Runtime\nfrom ..runtime import Runtime, config\n"
                     "def f():\n    from ..runtime.spawn import host_messages\n"
                     "if TYPE_CHECKING:\n    from ...runtime.net.transport import Transport\n"
                     "import monarch_kernel.runtime.wire.envelope\nfrom monarch_kernel.runtime import launcher\n"
                     "from monarch_kernel.runtime.config import seconds\nimport monarch_kernel.runtime\n"
                     "from .. import runtime\nfrom monarch_kernel.runtime import hosts\nfrom ..runtimes import x\n"
                     "from ..runtime.hosting import Runtime\n")
    names = {"main": {"Runtime", "config", "hosts"}, "hosting": {"Runtime", "AgentLink"}}
    found = _past_the_doors(pathlib.Path("kernel/x.py"), tree, names)
    assert sorted(int(b.split(":")[1].split()[0]) for b in found) == [1, 4, 6, 7, 8, 9, 14]
    # agents and jobs: the hosting door alone, and only what it hands on
    tree = ast.parse("from ..runtime import Runtime\nfrom ..runtime.hosting import Runtime, AgentLink\n"
                     "from ..runtime.hosting import Kind\nfrom ...runtime.spawn.agent_link import AgentLink\n")
    for where in ("job/x.py", "agent/x.py"):
        found = _past_the_doors(pathlib.Path(where), tree, names)
        assert sorted(int(b.split(":")[1].split()[0]) for b in found) == [1, 3, 4], found


def test_the_doors_hand_on_names_that_resolve():
    """Every name of each door loads (a renamed module or name breaks here, not in a rank),
    and the hosting door hands on the main door's own objects."""
    import monarch_kernel.runtime as main
    import monarch_kernel.runtime.hosting as hosting

    for door in (main, hosting):
        for name in door.__all__:
            assert getattr(door, name) is not None, f"{door.__name__}.{name}"
    assert hosting.Runtime is main.Runtime and hosting.config is main.config
    assert not {"Kind", "Part", "ENDPOINT_MARK"} & set(hosting.__all__), "agents and jobs make no actor calls"
    assert not {"AgentLink", "TemplateClient", "LaunchConfig", "host_messages"} & set(main.__all__)



# ---------------------------------------------------------------- the tests' own layering
# What tests share is the package tests/support/ (imported as ``support.NAME``); a test module
# (``test_*.py``) is imported by pytest alone.  Importing one from elsewhere runs its module
# code twice over and collects its tests again wherever its names land, and it ties a folder's
# tests to another folder's being on sys.path.  (A script a test writes and runs, which imports
# that test's own module for an actor class, is text, not an import of this process.)
TESTS = ROOT.parent / "tests"
TEST_NAME = re.compile(r"test_\w*")


def _test_module_imports(root: pathlib.Path) -> list[str]:
    """"FILE:LINE imports NAME" for each import, module-level or inner, anywhere under ``root``
    (test modules, conftest.py and support/ alike), of a name matching ``test_*``: a test
    module (``import test_api``, ``from test_debug import Session``, ``from . import test_x``,
    ``import tests.debug.test_debug``) or a name taken from one."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        nodes = sorted((n for n in ast.walk(ast.parse(path.read_text(), str(path)))
                        if isinstance(n, (ast.Import, ast.ImportFrom))), key=lambda n: n.lineno)
        for node in nodes:
            if isinstance(node, ast.Import):
                dotted = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                dotted = [f"{node.module}.{a.name}" if node.module else a.name for a in node.names]
            bad += [f"{rel}:{node.lineno} imports {name}" for name in dotted
                    if any(TEST_NAME.fullmatch(part) for part in name.split("."))]
    return bad


def test_no_test_module_is_imported_by_a_test_or_by_support():
    assert (TESTS / "support" / "__init__.py").is_file(), "tests/support/ must be a package (its __init__.py)"
    bad = _test_module_imports(TESTS)
    assert not bad, ("imports of a test module (move what is shared into tests/support/ and import it as "
                     "support.NAME):\n" + "\n".join(bad))


def test_the_test_import_check_sees_each_way_to_import_a_test_module(tmp_path):
    (tmp_path / "support").mkdir()
    (tmp_path / "support" / "__init__.py").write_text("")
    (tmp_path / "support" / "dap.py").write_text("from test_debug import Session\n")
    (tmp_path / "debug").mkdir()
    (tmp_path / "debug" / "test_a.py").write_text(
        "import os\nimport test_api, json\nfrom support.dap import Session\n"
        "def f():\n    from test_panel_lab import rest\n"
        "from . import test_b\nimport tests.debug.test_debug as d\nfrom support import attesting\n"
        "from support.actors import Counter\n")
    assert _test_module_imports(tmp_path) == [
        "debug/test_a.py:2 imports test_api", "debug/test_a.py:5 imports test_panel_lab.rest",
        "debug/test_a.py:6 imports test_b", "debug/test_a.py:7 imports tests.debug.test_debug",
        "support/dap.py:1 imports test_debug.Session"]
