"""runtime/__init__.py's front door: every name it lists resolves, and importing the package
alone loads none of its modules (its cost stays that of an empty package)."""

from __future__ import annotations

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
loaded = sorted(m for m in sys.modules if m.startswith("monarch_kernel.runtime."))
names = {n: type(getattr(runtime, n)).__name__ for n in runtime.__all__}
listed = sorted(runtime.__all__) == sorted([*runtime._WHERE, *runtime._MODULES])
print(json.dumps({"loaded": loaded, "names": names, "listed": listed}))
"""


def test_the_front_door_names_resolve_and_importing_it_loads_nothing():
    out = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT / "monarch_kernel")], capture_output=True,
                         text=True, timeout=30, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["loaded"] == []
    assert got["listed"], "__all__ is not exactly the names of _WHERE and _MODULES"
    assert got["names"]["Runtime"] == "type" and got["names"]["rank_label"] == "function"
    assert got["names"]["host_messages"] == "module"  # a wire format is exported as its module


def test_a_name_not_in_the_front_door_is_an_attribute_error():
    import monarch_kernel.runtime as runtime

    with pytest.raises(AttributeError, match="no_such_name"):
        runtime.no_such_name  # noqa: B018
