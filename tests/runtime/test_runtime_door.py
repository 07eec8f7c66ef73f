"""runtime/'s two doors (the package, and runtime/hosting.py): every name each lists resolves,
each list is the door's ``TYPE_CHECKING`` imports (written once), and importing a door alone
loads none of runtime/'s modules (its cost stays that of an empty package)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent.parent

# The package's own __init__ imports every layer; an empty stand-in for it leaves runtime/
# alone (which imports nothing above it, so its names still resolve).
_PROBE = """
import json, sys, types
package = types.ModuleType("monarch_kernel")
package.__path__ = [sys.argv[1]]
sys.modules["monarch_kernel"] = package
import monarch_kernel.runtime as runtime
import monarch_kernel.runtime.hosting as hosting
loaded = sorted(m for m in sys.modules if m.startswith("monarch_kernel.runtime."))
doors = {door.__name__: {n: type(getattr(door, n)).__name__ for n in door.__all__} for door in (runtime, hosting)}
print(json.dumps({"loaded": loaded, "doors": doors, "same": hosting.Runtime is runtime.Runtime}))
"""


def _written(path: Path) -> set[str]:
    """The names a door's ``if TYPE_CHECKING:`` block imports, read from its source."""
    block = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.If))
    return {a.asname or a.name for node in block.body for a in node.names}


def test_the_doors_names_resolve_and_importing_them_loads_nothing():
    out = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT / "monarch_kernel")], capture_output=True,
                         text=True, timeout=30, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    # the hosting door, and the small module that loads both doors' names on first use
    assert got["loaded"] == ["monarch_kernel.runtime.hosting", "monarch_kernel.runtime.lazy"]
    main, hosting = got["doors"]["monarch_kernel.runtime"], got["doors"]["monarch_kernel.runtime.hosting"]
    assert set(main) == _written(ROOT / "monarch_kernel" / "runtime" / "__init__.py")
    assert set(hosting) == _written(ROOT / "monarch_kernel" / "runtime" / "hosting.py")
    assert main["Runtime"] == "type" and main["rank_label"] == "function" and main["segments"] == "module"
    assert hosting["host_messages"] == "module"  # a wire format is handed on as its module
    assert hosting["Runtime"] == "type" and got["same"]  # the main door's names, handed on


def test_a_name_not_in_a_door_is_an_attribute_error():
    import monarch_kernel.runtime as runtime
    import monarch_kernel.runtime.hosting as hosting

    with pytest.raises(AttributeError, match="no_such_name"):
        runtime.no_such_name  # noqa: B018
    with pytest.raises(AttributeError, match="'monarch_kernel.runtime.hosting' has no attribute 'Kind'"):
        hosting.Kind  # noqa: B018
