"""``MONARCH_KERNEL_STRICT=1``: Monarch's behaviour where ours differs on purpose.  An
unhandled failure exits the controller with status 1 after it is reported, and an actor
class mixing sync and async endpoints is refused at spawn with Monarch's ValueError.  By
default the controller never exits and mixing is allowed.  Each mode runs in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import os, sys, threading

    class Watch:
        """stderr, noting when the unhandled failure's report has been written to it."""
        reported = threading.Event()

        def __init__(self, stream):
            self.stream = stream

        def write(self, text):
            if "nobody handles this" in text:
                self.reported.set()
            return self.stream.write(text)

        def __getattr__(self, name):
            return getattr(self.stream, name)

    sys.stderr = Watch(sys.stderr)  # before the runtime starts, so its reports go through it

    from monarch_kernel import Actor, endpoint, this_host

    class Mixed(Actor):
        @endpoint
        def sync_one(self):
            return "sync"

        @endpoint
        async def async_one(self):
            return "async"

    class Boom(Actor):
        @endpoint
        def go(self):
            raise RuntimeError("nobody handles this")

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        m = procs.spawn("mixed", Mixed)
        print(f"mixed {m.sync_one.call_one().get(timeout=30)} {m.async_one.call_one().get(timeout=30)}", flush=True)
    except ValueError as e:
        print(f"refused: {e}", flush=True)
    procs.spawn("boom", Boom).go.broadcast()
    if not Watch.reported.wait(60):
        print("no report of the unhandled failure within 60 s", flush=True)
    if os.environ.get("MONARCH_KERNEL_STRICT"):
        threading.Event().wait(60)  # strict mode exits meanwhile, once it has reported
    print("still here", flush=True)
    procs.stop().get(timeout=30)
''')


def _run(tmp_path, strict: bool) -> subprocess.CompletedProcess:
    script = tmp_path / "strict.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "MONARCH_KERNEL_STRICT"}
    if strict:
        env["MONARCH_KERNEL_STRICT"] = "1"
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env)


@pytest.mark.timeout(120)
def test_default_never_exits_and_allows_mixing(tmp_path):
    out = _run(tmp_path, strict=False)
    assert out.returncode == 0, out.stderr
    assert "mixed sync async" in out.stdout
    assert "monarch_kernel: unhandled failure on mesh" in out.stderr and "nobody handles this" in out.stderr
    assert out.stdout.rstrip().endswith("still here")


@pytest.mark.timeout(120)
def test_strict_refuses_mixing_and_exits_on_an_unhandled_failure(tmp_path):
    out = _run(tmp_path, strict=True)
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert ("refused: <class '__main__.Mixed'> mixes both async and sync endpoints.Synchronous endpoints "
            "cannot be mixed with async endpoints because they can cause the asyncio loop to deadlock if "
            "they wait.sync: ['sync_one'] async: ['async_one']") in out.stdout
    assert "monarch_kernel: unhandled failure on mesh" in out.stderr and "nobody handles this" in out.stderr
    assert "still here" not in out.stdout


@pytest.mark.timeout(10)
def test_strict_setting_is_read_from_the_environment(monkeypatch):
    from monarch_kernel.runtime import config

    monkeypatch.delenv("MONARCH_KERNEL_STRICT", raising=False)
    assert config.strict() is False
    for on in ("1", "true", "YES"):
        monkeypatch.setenv("MONARCH_KERNEL_STRICT", on)
        assert config.strict() is True
    monkeypatch.setenv("MONARCH_KERNEL_STRICT", "0")
    assert config.strict() is False
