"""What the debug package plugs into the runtime, and when: importing it installs nothing and
changes no environment variable; ``pdb_rank`` and ``PdbHub`` install their hooks when asked
and remove every one of them again; the ``(mesh pdb)`` prompt names ranks in the grammar of
``%%mesh --ranks``.  Fast; no rank processes."""

from __future__ import annotations

import builtins
import json
import os
import pdb
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from monarch_kernel.debug import messages
from monarch_kernel.debug.controller import pdb_controller, pdb_prompt, rank_stop
from monarch_kernel.debug.rank import pdb_rank
from monarch_kernel.runtime.process import Runtime

pytestmark = pytest.mark.timeout(60)

MODULES = ["dap", "messages", "rank.rank_debugpy", "rank.inspector", "rank.relay", "controller.tunnel", "rank.pdb_rank",
           "controller.pdb_prompt", "controller.rank_stop", "controller.pdb_controller", "controller.rank_target",
           "controller.proxy"]


def test_importing_the_debug_package_installs_nothing():
    # ipykernel's own debugger module (imported by every ipykernel before ours) sets
    # PYDEVD_USE_FRAME_EVAL and sys.breakpointhook when debugpy loads: count from after it.
    code = textwrap.dedent(f"""
        import json, os, pdb, sys
        import ipykernel.debugger
        env, hook, trace = dict(os.environ), sys.breakpointhook, pdb.set_trace
        for name in {MODULES!r}:
            __import__("monarch_kernel.debug." + name)
        from monarch_kernel.runtime.process import Runtime
        print(json.dumps({{
            "env": sorted(set(os.environ.items()) ^ set(env.items())),
            "breakpointhook": sys.breakpointhook is hook,
            "set_trace": pdb.set_trace is trace,
            "runtime": Runtime.existing() is not None,
        }}))
    """)
    out = subprocess.run([sys.executable, "-Xfrozen_modules=off", "-c", code], capture_output=True, text=True,
                         timeout=50)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"env": [], "breakpointhook": True, "set_trace": True, "runtime": False}, got


def test_pdb_rank_installs_through_the_hooks_and_removes_what_it_installed():
    hooks = Runtime.current().hooks
    before = (sys.breakpointhook, pdb.set_trace, hooks.endpoint_error.current())
    try:
        pdb_rank.install()
        pdb_rank.install()  # once is enough: a second console on the rank changes nothing
        assert sys.breakpointhook is pdb_rank.breakpointhook and pdb.set_trace is pdb_rank.set_trace
        pdb_rank.configure(post_mortem=True)
        pdb_rank.configure(post_mortem=True)
        assert len(hooks.endpoint_error.all()) == 1 + (before[2] is not None)
        pdb_rank.configure(post_mortem=False)
        assert hooks.endpoint_error.current() is before[2]
        pdb_rank.configure(post_mortem=True)
    finally:
        pdb_rank.uninstall()
        pdb_rank.config.post_mortem = False
    assert (sys.breakpointhook, pdb.set_trace, hooks.endpoint_error.current()) == before


def fake_session(meshes=None):
    """A ``PdbHost``: what the hub reads of the kernel."""
    return SimpleNamespace(meshes=meshes or {}, spawning=False, run_in_cell=lambda fn: fn(),
                           cell_label=lambda filename: None)


def test_pdb_names_the_notebooks_cells_as_ipython_does():
    """pdb's frame lines and a stop's place in a notebook cell read ``Cell In[7], line 4``."""
    names = {"/tmp/ipykernel_7/12.py": "Cell In[7]"}.get
    text = ("> /tmp/ipykernel_7/12.py(4)f()\n-> return x\n  /tmp/ipykernel_7/12.py(9)<module>()\n"
            "  /usr/lib/python3.11/runpy.py(88)_run_code()\n")
    assert rank_stop.name_cells(text, names) == (
        "> Cell In[7], line 4, in f()\n-> return x\n  Cell In[7], line 9\n"
        "  /usr/lib/python3.11/runpy.py(88)_run_code()\n")
    from monarch_kernel.debug.messages import Stopped

    stop = rank_stop.RankStop(Stopped("m", 1, 1, "/tmp/ipykernel_7/12.py", 4, "f", "breakpoint", False, "", ()),
                              names=names)
    assert stop.place() == "Cell In[7], line 4"


def test_the_pdb_hub_installs_its_hooks_and_close_removes_them():
    hooks = Runtime.current().hooks
    hub = pdb_controller.PdbHub(fake_session())
    try:
        assert isinstance(hooks.wait.current(), pdb_controller.ServeWhileWaiting)
        assert hooks.wait.current().hub is hub
        assert hub.mesh_spawned in hooks.spawned.all()
        hub.install()  # already installed: nothing more
        assert sum(f == hub.mesh_spawned for f in hooks.spawned.all()) == 1
    finally:
        hub.close()
    assert not any(isinstance(w, pdb_controller.ServeWhileWaiting) for w in hooks.wait.all())
    assert hub.mesh_spawned not in hooks.spawned.all()
    assert not Runtime.current().ports.close(hub.port.port_id)  # closed already
    hub.close()  # twice is harmless


class FakeHub:
    """What PdbCommands needs of a hub, recording what it would send."""

    def __init__(self, stops, mesh_size):
        self.stops, self.mesh_size = stops, mesh_size
        self.written, self.casts = [], []
        self.attached, self.chose_detach = None, False

    def waiting(self):
        return self.stops

    def rank_count(self, stops=()):
        return self.mesh_size

    def write(self, text):
        self.written.append(text)

    def cast(self, stops, cmd):
        self.casts.append(([s.rank for s in stops], cmd))


def stops(ranks):
    return [rank_stop.RankStop(messages.Stopped("procs", r, 1, "/c.py", 3, "<module>", "breakpoint", True),
                               state="waiting") for r in ranks]


@pytest.mark.parametrize("line, casts, said", [
    ("cast ::2 p x", [([0, 2], "p x")], ""),
    ("cast 1-2,3 n", [([1, 2, 3], "n")], ""),
    ("cast 0-9 p x", [], "cast '0-9': the mesh has ranks 0-3; type  cast RANKS CMD"),
    ("cast x p x", [], "cast 'x': write ranks like 0, 0-3, 0,2 or ::2"),
    ("continue", [([0, 1, 2, 3], "c")], ""),
    ("attach 0-1", [], "type  attach R  with one stopped rank's number"),
])
def test_the_mesh_pdb_prompt_names_ranks_as_mesh_ranks_does(monkeypatch, line, casts, said):
    hub = FakeHub(stops(range(4)), 4)
    monkeypatch.setattr(builtins, "input", lambda prompt: line)
    pdb_prompt.PdbCommands(hub).prompt(hub.stops)
    assert hub.casts == casts
    assert said in "".join(hub.written), hub.written


def test_attach_at_the_prompt_picks_one_stopped_rank(monkeypatch):
    hub = FakeHub(stops([1, 3]), 4)
    monkeypatch.setattr(builtins, "input", lambda prompt: "attach 3")
    pdb_prompt.PdbCommands(hub).prompt(hub.stops)
    assert hub.attached == ("procs", 3, 1)
    monkeypatch.setattr(builtins, "input", lambda prompt: "attach 2")
    pdb_prompt.PdbCommands(hub).prompt(hub.stops)
    assert "rank 2 is not stopped; stopped: 1, 3" in "".join(hub.written)


def test_the_frames_skipped_when_stepping_are_the_whole_packages():
    import monarch_kernel
    from monarch_kernel.debug.rank import rank_debugpy

    assert rank_debugpy.package_dir() == os.path.dirname(os.path.abspath(monarch_kernel.__file__))
