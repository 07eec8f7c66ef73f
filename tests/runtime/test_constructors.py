"""One named constructor per process: a host's agent builds only the parts it uses (it
talks to its controller: no caller, server, actors, supervision or launcher), and handles
only the kinds such a process can receive; the controller builds them all."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from monarch_kernel.runtime import Runtime
from monarch_kernel.runtime.wire.envelope import Kind

pytestmark = pytest.mark.timeout(60)

CALLING = ("caller", "gathering", "server", "actor_lives", "supervision", "launcher", "rank_events", "host_links")


AGENT = """
import json, sys, tempfile
from monarch_kernel.runtime import Runtime
from monarch_kernel.runtime.net.io_thread import IOThread
from monarch_kernel.runtime.wire.curve import CurveKeys
rt = Runtime.for_agent(key=b"k" * 32, rundir=tempfile.mkdtemp(), controller="tcp://127.0.0.1:9",
                       address="tcp://127.0.0.1:*", curve=CurveKeys.generate(), io=IOThread())
print(json.dumps({"parts": [p for p in sys.argv[1:] if hasattr(rt, p)], "kinds": sorted(rt.handlers),
                  "address": rt.address, "current": Runtime.existing() is rt}))
"""


def test_an_agent_builds_only_what_it_uses():
    # in a process of its own, as an agent runs (a runtime is never torn down in-process)
    out = subprocess.run([sys.executable, "-c", AGENT, *CALLING], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["parts"] == [] and not got["current"]
    assert got["kinds"] == sorted([Kind.PORT, Kind.WAKE, Kind.HOST])
    assert got["address"].startswith("tcp://127.0.0.1:")


def test_the_controller_builds_every_part_and_handles_every_kind():
    rt = Runtime.current()
    assert all(hasattr(rt, p) for p in CALLING)
    assert {Kind.CALL, Kind.SPAWN, Kind.REPLY, Kind.DEATH, Kind.STOP, Kind.PORT, Kind.HOST} <= set(rt.handlers)
    assert rt.server.actors is rt.actor_lives.actors and rt.launcher.links is rt.host_links.links
