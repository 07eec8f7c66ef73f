"""What the kernel says about what it did, through a real kernel: every ``%mesh`` action in
one line, the status widget's last word when its mesh stops, a restarted kernel attaching its
notebook's own detached mesh, a shutdown that leaves nothing on stderr, and ``%mesh tensors``
naming each tensor by the notebook variable that holds it."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid

import pytest
from support.kernels import assert_gone, finished, iopub, run, started, text

from monarch_kernel.kernel.status import REFRESH_S

pytestmark = pytest.mark.timeout(180)


def test_tensors_are_named_by_the_variables_that_hold_them_and_the_rest_counted(kc):
    out, reply = run(kc, "import torch\nprocs = %mesh spawn -n 2\nwith procs.activate():\n"
                         "    w = torch.ones(4, 4)\n    losses = [torch.ones(()) * i for i in range(3)]\n"
                         "    model = torch.nn.Linear(4, 2)\n"
                         "    held = (lambda ts: lambda: ts)([torch.zeros(()) + i for i in range(22)])\n"
                         "    odd = (lambda t: lambda: t)(torch.zeros(2, 3))", timeout=120)
    assert reply["status"] == "ok", text(out)
    out, reply = run(kc, "%mesh tensors")
    assert reply["status"] == "ok", text(out)
    lines = text(out).splitlines()
    assert lines[0] == "procs: 29 tensors, 228 bytes per rank", lines
    rows = [" ".join(line.split()) for line in lines[1:]]
    assert rows == [
        "w [4, 4] float32 on cpu: 64 bytes per rank",
        "losses[0-2] 3 × [] float32 on cpu: 12 bytes per rank",
        "model.weight [2, 4] float32 on cpu: 32 bytes per rank",
        "model.bias [2] float32 on cpu: 8 bytes per rank",
        "1 temporary [2, 3] float32 on cpu: 24 bytes per rank",
        "22 scalar temporaries, 88 bytes per rank",
    ], lines


# ---------------------------------------------------------------- lifecycle


def widget_values(kc, model_id: str, since: int = 0) -> list[str]:
    """The HTML values a widget was sent (its comm's updates), in order."""
    return [m.content["data"]["state"]["value"] for m in iopub(kc).messages[since:]
            if m.msg_type == "comm_msg" and m.content.get("comm_id") == model_id
            and "value" in m.content.get("data", {}).get("state", {})]


def test_the_status_widget_says_stopped_when_its_mesh_stops(kc):
    run(kc, "procs = %mesh spawn -n 2")
    out, reply = run(kc, "%mesh status")
    (model_id,) = [o.data["application/vnd.jupyter.widget-view+json"]["model_id"]
                   for o in out if o.kind == "display_data"]
    seen = len(iopub(kc).messages)
    out, reply = run(kc, "%mesh stop")
    assert reply["status"] == "ok", text(out)
    last = iopub(kc).wait("the status widget's last word", lambda: widget_values(kc, model_id, seen), 10)[-1]
    assert "stopped" in last and "idle" not in last, last
    assert last.count(">stopped<") == 2, last  # each rank
    iopub(kc).pump(2 * REFRESH_S)  # and it is not refreshed again
    assert widget_values(kc, model_id, seen)[-1] == last


def one_line(kc, code: str) -> str:
    """What cell ``code`` printed, which must be one line."""
    out, reply = run(kc, code, timeout=120)
    assert reply["status"] == "ok", text(out)
    printed = text(o for o in out if o.kind == "stream")
    assert printed.endswith("\n") and printed.count("\n") == 1, printed
    return printed.rstrip("\n")


def test_every_mesh_action_says_what_it_did_in_one_line(kc):
    assert one_line(kc, "procs = %mesh spawn -n 2") == "mesh procs: 2 ranks on this host"
    assert one_line(kc, "other = %mesh spawn -n 1 --name other") == "mesh other: 1 rank on this host"
    assert one_line(kc, "%mesh use procs") == "mesh procs is current: %%mesh cells run on its 2 ranks"
    assert one_line(kc, "%mesh push lr=0.1 wd=0") == "pushed lr, wd to ranks 0-1"
    assert one_line(kc, "%mesh scatter part=[1,2]") == "scattered part: one piece to each of ranks 0-1"
    assert one_line(kc, "%mesh auto on") == ("auto on: every cell runs on mesh procs (%mesh lines stay here; "
                                             "%mesh auto off ends it)")
    assert one_line(kc, "%mesh auto off") == "auto off: cells run here again"
    assert one_line(kc, "%mesh stop other") == "stopped mesh other: its 1 rank ended"
    assert one_line(kc, "%mesh stop") == "stopped mesh procs: its 2 ranks ended"


@contextlib.contextmanager
def jupyter_kernel(kernelspec: str, notebook: str = "", stderr=None):
    """A kernel started as Jupyter Server starts a notebook's: its connection file named
    after its kernel id (kept across a restart), the notebook's path in ``JPY_SESSION_NAME``;
    yields (manager, client, kernel id).  Shut down (and waited for) on exit."""
    from jupyter_client import KernelManager
    from jupyter_core.paths import jupyter_runtime_dir

    kernel_id = str(uuid.uuid4())
    os.makedirs(jupyter_runtime_dir(), exist_ok=True)
    env = dict(os.environ, JPY_SESSION_NAME=notebook) if notebook else dict(os.environ)
    km, kc = started(lambda: KernelManager(
        kernel_name=kernelspec, connection_file=os.path.join(jupyter_runtime_dir(), f"kernel-{kernel_id}.json")),
        env=env, **({"stderr": stderr} if stderr is not None else {}))
    try:
        yield km, kc, kernel_id
    finally:
        finished(km, kc)


def _end_detached(name: str) -> None:
    """A test that failed midway leaves no detached mesh running: its host is killed (its
    ranks die with it)."""
    from monarch_kernel.detached import records

    record = records.read(name)
    if record is not None and record.alive():
        os.kill(record.pid, signal.SIGKILL)
        assert_gone([record.pid], 10, f"the host of detached mesh {name} stayed")
    records.forget(name)


def test_a_restarted_kernel_attaching_its_notebooks_detached_mesh_says_attached(kernelspec, tmp_path):
    name = f"mine{uuid.uuid4().hex[:6]}"
    notebook, other = str(tmp_path / "train.ipynb"), str(tmp_path / "other.ipynb")
    try:
        with jupyter_kernel(kernelspec, notebook) as (km, kc, _kernel_id):
            assert one_line(kc, f"procs = %mesh spawn -n 2 --detach {name}") == (
                f"mesh {name}: 2 ranks, detached: they outlive this kernel (%mesh attach {name} reconnects "
                "after a restart)")
            km.restart_kernel(now=False)  # the notebook's Restart: the same kernel id, a new process
            kc.wait_for_ready(timeout=60)
            assert one_line(kc, f"procs = %mesh attach {name}") == (
                f"attached detached mesh '{name}': 2 ranks, as this notebook's kernel had it before its restart")
        with jupyter_kernel(kernelspec, notebook) as (_km, kc, first):  # the notebook's next kernel
            assert one_line(kc, f"%mesh attach {name}") == (
                f"attached detached mesh '{name}': 2 ranks, as this notebook's earlier kernel had it")
            with jupyter_kernel(kernelspec, other) as (_km2, kc2, _second):  # another notebook's, meanwhile
                said = one_line(kc2, f"%mesh attach {name}")
                assert said.startswith(f"attached detached mesh '{name}': 2 ranks; it was attached to another "
                                       f"kernel, kernel {first} (pid "), said
                assert said.endswith("), which no longer gets its output"), said
                assert one_line(kc2, f"%mesh stop {name}") == (
                    f"stopped detached mesh '{name}': its 2 ranks and its host process ended")
    finally:
        _end_detached(name)


def test_shutdown_leaves_nothing_on_the_kernels_stderr(kernelspec, tmp_path):
    """No asyncio warning ("Task was destroyed but it is pending!"), nothing at all but the
    line every ipykernel prints at start, after a session that used a mesh, its status widget
    and the control channel while the kernel shut down (as Jupyter Server's nudges do)."""
    path = tmp_path / "kernel.stderr"
    with open(path, "w") as err:
        with jupyter_kernel(kernelspec, stderr=err) as (km, kc, _kernel_id):
            for cell in ("procs = %mesh spawn -n 2", "%%mesh\nprint('hello')", "%mesh status"):
                out, reply = run(kc, cell)
                assert reply["status"] == "ok", text(out)
            kc.shutdown()
            deadline = time.monotonic() + 30
            while km.is_alive():
                assert time.monotonic() < deadline, "timed out after 30 s waiting for the kernel to shut down"
                kc.control_channel.send(kc.session.msg("kernel_info_request"))
                time.sleep(0.05)
    said = [line for line in path.read_text().splitlines() if line.strip() and "without encryption" not in line]
    assert said == [], "\n".join(said)
