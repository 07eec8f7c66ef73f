"""The controller→template wire: MeshRef and LaunchConfig round-trip through msgpack (and a
MeshRef through JSON), the template modules install nothing when imported, and neither
template module imports the rank or the runtime at import time (no import cycle)."""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from monarch_kernel.runtime.context import MeshRef
from monarch_kernel.runtime.spawn import host_messages, template_channel, template_client
from monarch_kernel.runtime.spawn.launch_config import LaunchConfig
from monarch_kernel.runtime.template import fork as template_fork
from monarch_kernel.runtime.template import server as template_server

pytestmark = pytest.mark.timeout(60)

RUNTIME = Path(template_server.__file__).parent.parent

REF = MeshRef("m1a2b3c4", "gpus", (("hosts", 2), ("gpus", 2)),
              tuple(f"ipc:///tmp/run/m1a2b3c4.{r}" for r in range(4)), "ipc:///tmp/run/c42", ("h0",) * 4)


def _config(**over) -> LaunchConfig:
    fields = dict(key=bytes(range(32)), rundir="/tmp/run", owner="ipc:///tmp/run/c42", rank=3, mesh=REF,
                  sys_path=("", "/src", "/usr/lib/python3"), cwd="/src", env={"A": "1", "Ü": "é"},
                  fanout=8, cleanup_dirs=("/tmp/run", "/dev/shm/seg"))
    fields.update(over)
    return LaunchConfig(**fields)


@pytest.mark.parametrize("ref", [
    REF,
    MeshRef("p00", "this_proc", (), ("ipc:///tmp/run/c42",), "ipc:///tmp/run/c42", ("h0",)),
    MeshRef("m0", "empty", (("gpus", 0),), (), "tcp://10.0.0.1:5555"),
])
def test_mesh_ref_round_trips_through_msgpack_and_json(ref):
    wire = ref.to_wire()
    assert MeshRef.from_wire(wire) == ref
    assert MeshRef.from_wire(msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False)) == ref
    assert MeshRef.from_wire(json.loads(json.dumps(wire))) == ref


def test_mesh_ref_wire_form_is_the_list_every_reader_already_parses():
    # [id, name, dims, addresses, owner, hosts]: the form records and launch configs held before.
    assert REF.to_wire() == ["m1a2b3c4", "gpus", [["hosts", 2], ["gpus", 2]],
                             [f"ipc:///tmp/run/m1a2b3c4.{r}" for r in range(4)], "ipc:///tmp/run/c42", ["h0"] * 4]


@pytest.mark.parametrize("bad", [None, "m1", ["m1", "gpus"], {"id": "m1"}])
def test_mesh_ref_from_wire_names_the_expected_form(bad):
    with pytest.raises(ValueError,
                       match=r"a mesh reference on the wire is \[id, name, dims, addresses, owner, hosts\]"):
        MeshRef.from_wire(bad)


@pytest.mark.parametrize("cfg", [_config(), _config(cleanup_dirs=(), env={}, rank=0)])
def test_launch_config_round_trips_through_msgpack(cfg):
    wire = cfg.to_wire()
    back = LaunchConfig.from_wire(msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False))
    assert back == cfg
    assert isinstance(back.key, bytes) and isinstance(back.mesh, MeshRef)


def test_launch_config_wire_keys():
    assert sorted(_config().to_wire()) == sorted(
        ["key", "rundir", "owner", "rank", "mesh", "sys_path", "cwd", "env", "fanout", "cleanup_dirs",
         "bootstrap", "job_ports", "curve", "address", "python", "forwards"])


def test_launch_config_passes_the_template_wire_with_its_fds():
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        template_channel.send_msg(here, host_messages.Fork(1, _config().to_wire()), [w])
        msg, fds = template_channel.recv_msg(there)
        assert msg.OP == "fork" and msg.tag == 1
        assert LaunchConfig.from_wire(msg.config) == _config()
        assert len(fds) == 1
        os.write(fds[0], b"x")  # the passed fd is the pipe's write end
        assert os.read(r, 1) == b"x"
        os.close(fds[0])
        here.close()
        assert template_channel.recv_msg(there) == (None, [])  # EOF once the other end is gone
    finally:
        for f in (r, w):
            os.close(f)
        there.close()


_PROBE = """
import atexit, json, os, signal, sys, threading
import cloudpickle, msgpack, zmq  # third-party imports register their own atexit callbacks
def state():
    handlers = {}
    for s in signal.valid_signals():
        try:
            handlers[int(s)] = repr(signal.getsignal(s))
        except (ValueError, OSError):
            pass
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    return {"threads": sorted(t.name for t in threading.enumerate()), "signals": handlers,
            "wakeup_fd": wakeup, "environ": dict(os.environ), "atexit": atexit._ncallbacks(),
            "breakpointhook": repr(sys.breakpointhook), "excepthook": repr(sys.excepthook)}
before = state()
import monarch_kernel.runtime.template.server, monarch_kernel.runtime.spawn.template_client
import monarch_kernel.runtime.spawn.template_channel, monarch_kernel.runtime.spawn.launch_config
import monarch_kernel.runtime.spawn.host_messages
print(json.dumps({"before": before, "after": state()}))
"""


def test_importing_the_template_and_launch_modules_installs_nothing():
    # A fresh interpreter: in this one the package is long imported.
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=30,
                         cwd=RUNTIME.parent.parent)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    before, after = seen["before"], seen["after"]
    for what in before:
        assert after[what] == before[what], f"importing the template modules changed {what}"


def _module_level_imports(path: Path) -> set[str]:
    """Relative module names imported at module level (not inside functions)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = node.module or ""
            names.update([base] if base else [a.name for a in node.names])
    return names


@pytest.mark.parametrize("module", ["spawn/template_client", "template/server", "template/fork",
                                    "spawn/template_channel", "spawn/host_messages", "template/process_tree",
                                    "spawn/launch_config"])
def test_template_modules_do_not_import_the_rank_or_runtime_at_import_time(module):
    imported = _module_level_imports(RUNTIME / f"{module}.py")
    assert not imported & {"rank", "process", "supervision", "launcher", "serving"}, imported
    if module == "spawn/template_client":
        assert not any("template" in m.split(".") for m in imported), "the controller's side imports the template's"


def test_the_controller_starts_the_template_by_a_recognisable_command_line():
    # tests/conftest.py tells a template from a leaked rank by this string.
    assert "template.server import serve" in template_client.SERVE


def test_the_template_warm_up_imports_resolve():
    # A module renamed under actor/ would otherwise surface as every spawn failing.
    from monarch_kernel.actor.host_mesh import RANK_MODULES

    template_fork.warm_up(list(RANK_MODULES))
