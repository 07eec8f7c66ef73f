"""The runtime's one hook registry: installing returns a handle that uninstalls, single and
multi points behave as documented, patches are undone, and importing any module of the
package installs nothing at all (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types

import pytest

from monarch_kernel.runtime.hooks import Handle, HookPoint, Hooks

pytestmark = pytest.mark.timeout(60)


def test_a_single_point_uses_its_newest_function_and_falls_back_to_its_default():
    point: HookPoint = HookPoint("output", multi=False, default=print)
    assert point.current() is print
    first, second = (lambda *a: None), (lambda *a: None)
    h1 = point.install(first)
    h2 = point.install(second)
    assert point.current() is second and point.has(first)
    h2.remove()
    assert point.current() is first
    h2.remove()  # a second remove is harmless
    h1.remove()
    assert point.current() is print and not h1.installed


def test_a_multi_point_calls_every_function_in_order_and_removes_only_its_own():
    point: HookPoint = HookPoint("death", multi=True)
    calls = []
    a = point.install(lambda *x: calls.append("a"))
    same = lambda *x: calls.append("b")  # noqa: E731
    b1, b2 = point.install(same), point.install(same)
    for fn in point.all():
        fn()
    assert calls == ["a", "b", "b"]
    b1.remove()
    assert len(point.all()) == 2
    a.remove()
    b2.remove()
    assert point.all() == []


def test_patches_are_undone_unless_patched_again_since():
    hooks = Hooks()
    target = types.SimpleNamespace(fn="original")
    table = {"k": 1}
    h = hooks.patch(target, "fn", "patched")
    d = hooks.patch(table, "k", 2)
    new = hooks.patch(table, "fresh", 3)
    assert (target.fn, table) == ("patched", {"k": 2, "fresh": 3})
    h.remove()
    d.remove()
    new.remove()
    assert (target.fn, table) == ("original", {"k": 1})
    h2 = hooks.patch(target, "fn", "mine")
    target.fn = "someone else's"  # patched again by another party: leave theirs alone
    h2.remove()
    assert target.fn == "someone else's"


def test_handle_is_what_install_returns():
    assert isinstance(Hooks().death.install(lambda *a: None), Handle)


SNAPSHOT = textwrap.dedent("""
    import json, os, signal, sys, threading, atexit, importlib, pkgutil
    # Third-party modules with import-time effects of their own (exit handlers; debugpy, which
    # ipykernel's debugger imports, sets sys.breakpointhook) are imported first: what is
    # checked is what importing this package's modules adds.  torch too: the distributed
    # tensors' modules (loaded only once a tensor exists) import it, and it registers exit handlers.
    import zmq, msgpack, cloudpickle, ipykernel.debugger, torch
    import IPython.core.display_functions as df, IPython.display as ipd
    def state():
        return {
            "env": dict(os.environ),
            "threads": sorted(t.name for t in threading.enumerate()),
            "signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)},
            "breakpointhook": repr(sys.breakpointhook), "excepthook": repr(sys.excepthook),
            "display": [repr(df.display), repr(ipd.display)],
            "pickle_table": sorted(map(repr, cloudpickle.Pickler._dispatch_table)),
            "code_reducer": repr(cloudpickle.Pickler._dispatch_table.get(type(state.__code__))),
            "atexit": atexit._ncallbacks(),
        }
    before = state()
    import monarch_kernel
    names = []
    for mod in pkgutil.walk_packages(monarch_kernel.__path__, "monarch_kernel."):
        if mod.name.endswith("__main__"):
            continue  # running a package's __main__ is not importing it
        importlib.import_module(mod.name)
        names.append(mod.name)
    after = state()
    print(json.dumps({"names": names, "changed": {k: [before[k], after[k]] for k in before if before[k] != after[k]}}))
""")


def test_importing_every_module_installs_nothing():
    r = subprocess.run([sys.executable, "-c", SNAPSHOT], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "monarch_kernel.kernel.magics" in out["names"] and "monarch_kernel.debug.rank.pdb_rank" in out["names"]
    assert out["changed"] == {}, out["changed"]
