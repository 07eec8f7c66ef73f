"""The launcher's side of a mesh's life: ranks and the template go with a controller that is
killed or exits without stopping them; a stop resolves once the ranks are gone, even one whose
loop is blocked; a restart asked for the moment a death is seen; and what ranks import."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading

import pytest
from support.actors import Echo, alive, kill_all, wait_for, wait_gone
from support.scripts import run_script, write_script

from monarch_kernel import MeshStopped, ProcessDied, this_host
from monarch_kernel.runtime.process import Runtime


class Controller:
    """A controller script running in a subprocess; its first stdout line is JSON."""

    def __init__(self, path: str, *args):
        self.proc = subprocess.Popen([sys.executable, path, *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self._lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.pids: list[int] = []

    def _pump(self):
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def first_json(self, timeout: float) -> dict:
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"controller printed nothing within {timeout} s") from None
            if line is None:
                raise AssertionError(f"controller exited (rc {self.proc.wait()}): {self.proc.stderr.read()}")
            if line.startswith("{"):
                info = json.loads(line)
                self.pids = [*info["ranks"], info["template"]]
                return info

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        kill_all(alive(self.pids))  # only if the test already failed
        self.proc.stdout.close()
        self.proc.stderr.close()



# ---------------------------------------------------------------- restarting


@pytest.mark.timeout(60)
def test_a_restart_asked_for_as_soon_as_the_death_is_seen_never_sees_that_death():
    """The caller hears ProcessDied while the IO thread is still handling the death (here a
    death hook holds it there, as slow sends of DEATH notices to other hosts did); a restart
    asked for at that moment must wait for that handling, not be failed by it."""
    rt = Runtime.current()
    slow = rt.hooks.death.install(lambda *_: __import__("time").sleep(0.5))
    try:
        with this_host().spawn_procs(per_host={"gpus": 2}, name="restarted") as procs:
            m = procs.spawn("echo", Echo)
            old = m.slice(gpus=1).pid.call_one().get(timeout=30)
            with pytest.raises(ProcessDied):
                m.slice(gpus=1).exit_with.call_one(7, "bye").get(timeout=30)
            procs.restart([1], [(m, Echo, (), {})])
            assert m.slice(gpus=1).pid.call_one().get(timeout=30) != old
    finally:
        slow.remove()


# ---------------------------------------------------------------- the controller going away


CONTROLLER_SCRIPT = """
import json, sys, time
from monarch_kernel import this_host
from monarch_kernel.runtime.process import Runtime
from support.actors import Echo

procs = this_host().spawn_procs(per_host={"gpus": 4})
m = procs.spawn("echo", Echo)
pids = list(m.pid.call().get(timeout=30).values())
rt = Runtime.current()
print(json.dumps({"ranks": pids, "template": rt.launcher.template.proc.pid, "rundir": rt.rundir}), flush=True)
how = sys.argv[1]
if how == "sleep":
    time.sleep(600)
elif how == "exit":
    sys.exit(4)
elif how == "raise":
    raise RuntimeError("controller script failed")
# "end": fall off the end without stopping the mesh
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killed_controller_takes_ranks_and_template_with_it(tmp_path, sig):
    path = write_script(tmp_path, "controller.py", CONTROLLER_SCRIPT)
    c = Controller(path, "sleep")
    try:
        info = c.first_json(timeout=40)
        assert alive(c.pids) == c.pids
        os.kill(c.proc.pid, sig)
        assert c.proc.wait(timeout=20) == -sig
        assert wait_gone(c.pids, 3.0) == [], "ranks or template outlived their controller by 3 s"
        assert len(info["ranks"]) == 4
        assert not os.path.exists(info["rundir"]), "the template leaves no run directory behind"
    finally:
        c.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how, rc", [("end", 0), ("exit", 4), ("raise", 1)])
def test_controller_exit_without_stop_ends_ranks(tmp_path, how, rc):
    path = write_script(tmp_path, "controller.py", CONTROLLER_SCRIPT)
    c = Controller(path, how)
    try:
        info = c.first_json(timeout=40)
        assert c.proc.wait(timeout=30) == rc
        assert wait_gone(c.pids, 3.0) == [], "ranks or template outlived their controller by 3 s"
        assert not os.path.exists(info["rundir"])
        err = c.proc.stderr.read()
        if how == "raise":
            assert "RuntimeError: controller script failed" in err
        else:
            assert "Traceback" not in err, err
    finally:
        c.close()


# ---------------------------------------------------------------- stopping


@pytest.mark.timeout(60)
def test_stop_resolves_once_ranks_are_gone():
    procs = this_host().spawn_procs(per_host={"gpus": 4})
    try:
        m = procs.spawn("echo", Echo)
        pids = list(m.pid.call().get(timeout=30).values())
        busy = m.sleep.call(30)  # a sync endpoint running does not delay the stop
    finally:
        fut = procs.stop()
    assert fut.get(timeout=20) is None
    assert alive(pids) == []  # reaped before the future resolved
    assert procs.stop() is fut
    assert "stopped" in repr(procs)
    with pytest.raises(MeshStopped):
        busy.get(timeout=20)


@pytest.mark.timeout(60)
def test_stop_kills_a_rank_whose_loop_is_blocked(tmp_path):
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        m = procs.spawn("echo", Echo)
        pids = list(m.pid.call().get(timeout=30).values())
        m.slice(gpus=0).block_loop.call_one(600, str(tmp_path))  # rank 0 cannot even read the STOP
        assert wait_for(lambda: (tmp_path / "blocked.0").exists(), 20)
        assert m.slice(gpus=1).echo.call_one(1).get(timeout=20) == 1
    finally:
        fut = procs.stop()
    assert fut.get(timeout=20) is None
    assert alive(pids) == []


@pytest.mark.timeout(60)
def test_context_manager_stops_on_exit_and_on_error():
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        pids = list(procs.spawn("echo", Echo).pid.call().get(timeout=30).values())
        assert alive(pids) == pids
    assert alive(pids) == []
    assert "stopped" in repr(procs)

    with pytest.raises(RuntimeError, match="user code failed"):
        with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
            pids = list(procs.spawn("echo", Echo).pid.call().get(timeout=30).values())
            raise RuntimeError("user code failed")
    assert alive(pids) == []


# ---------------------------------------------------------------- what ranks import


MAIN_SCRIPT = """
import json
import sys
print("MAIN IMPORTED", flush=True)
import torch  # the controller uses torch; ranks must not import it for it

from monarch_kernel import Actor, endpoint, this_host

class Probe(Actor):
    @endpoint
    def modules(self):
        import sys
        main = sys.modules.get("__main__")
        print("probe ran", flush=True)
        return {"torch": "torch" in sys.modules, "main_file": getattr(main, "__file__", None)}

if __name__ == "__main__":
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        m = procs.spawn("probe", Probe)
        # One write: print() writes the text and the newline separately, and a rank's line
        # forwarded by the IO thread could land between them.
        sys.stdout.write("RESULT " + json.dumps(list(m.modules.call().get(timeout=30).values())) + "\\n")
        sys.stdout.flush()
"""


@pytest.mark.timeout(60)
def test_ranks_import_neither_torch_nor_main(tmp_path):
    path = write_script(tmp_path, "main_script.py", MAIN_SCRIPT)
    out = run_script(path, timeout=50)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines.count("MAIN IMPORTED") == 1
    assert "MAIN IMPORTED" not in out.stdout.replace("MAIN IMPORTED", "", 1)
    assert sorted(line for line in lines if "probe ran" in line) == ["[rank 0] probe ran", "[rank 1] probe ran"]
    res = json.loads(next(line for line in lines if line.startswith("RESULT ")).removeprefix("RESULT "))
    assert [r["torch"] for r in res] == [False, False]
    assert all(r["main_file"] != path for r in res)

    # The same holds for ranks of this test process.
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        vm = procs.spawn("echo", Echo).modules.call().get(timeout=30)
        assert [v["torch"] for v in vm.values()] == [False, False]


TEMPLATES_SCRIPT = """
import psutil
from monarch_kernel import this_host
from monarch_kernel.runtime.process import Runtime

def templates():
    return [p.pid for p in psutil.Process().children() if "template.server import serve" in " ".join(p.cmdline())]

rt = Runtime.current()
rt.start_templates(4)
rt.start_templates(4)  # asked again (a cell run again): the one started has room
with this_host().spawn_procs(per_host={"gpus": 4}) as procs:  # it starts them too, and forks from that one
    print("TEMPLATES", len(templates()), flush=True)
    procs.stop().get(timeout=30)
try:  # an interpreter that cannot run: the spawn says so, and nothing else does
    this_host().with_python_executable("/nonexistent/python").spawn_procs(per_host={"gpus": 1})
except FileNotFoundError as e:
    print("REFUSED", e.filename, flush=True)
"""


@pytest.mark.timeout(60)
def test_templates_started_ahead_of_a_spawn_are_the_ones_it_forks_from(tmp_path):
    """A spawn starts its templates before it sets up the rest (their start overlaps it):
    asking again, or the spawn itself, starts no second one while the first has room; an
    interpreter that cannot run is refused by the spawn, once."""
    out = run_script(write_script(tmp_path, "templates.py", TEMPLATES_SCRIPT), timeout=50)
    assert out.returncode == 0, out.stderr
    assert "TEMPLATES 1" in out.stdout.splitlines(), out.stdout + out.stderr
    assert "REFUSED /nonexistent/python" in out.stdout.splitlines(), out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr  # the early start's failure is the spawn's to say
