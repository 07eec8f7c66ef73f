"""A detached mesh's record on its own: written 0600 and read back whole (its mesh
references too), an unreadable one reads as a dead host, a pid is alive only with its own
start time, and forgetting removes the record and its log.  No mesh is started."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from monarch_kernel.detached import records
from monarch_kernel.detached.records import Record
from monarch_kernel.runtime.context import MeshRef

pytestmark = pytest.mark.timeout(30)

MESH = MeshRef("m1a2b3c4", "keepme", (("ranks", 2),), ("ipc:///tmp/run/m1a2b3c4.0", "ipc:///tmp/run/m1a2b3c4.1"),
               "ipc:///tmp/run/host", ("h0", "h0"))
HOST = MeshRef("p00", "this_proc", (), ("ipc:///tmp/run/host",), "ipc:///tmp/run/host", ("h0",))


@pytest.fixture(autouse=True)
def runtime_dir(tmp_path, monkeypatch):
    """Records of this test only, in a runtime directory that does not exist yet."""
    path = tmp_path / "runtime"
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(path))
    return path


def record(name: str = "keepme", pid: int | None = None) -> Record:
    pid = os.getpid() if pid is None else pid
    return Record(name, pid, records.start_time(pid), "ab" * 32, MESH.to_wire(), HOST.to_wire(),
                  "consoles-1", "host-1")


def test_a_record_round_trips_through_its_file(runtime_dir):
    rec = record()
    rec.write()
    path = records.info_path("keepme")
    assert path == str(runtime_dir / "monarch-mesh-keepme.json")
    assert oct(os.stat(path).st_mode & 0o777) == "0o600", "the job key must be readable by its owner only"
    assert oct(os.stat(runtime_dir).st_mode & 0o777) == "0o700"
    back = records.read("keepme")
    assert back == rec
    assert back.ref == MESH and back.host_ref == HOST
    with open(path) as f:
        fields = json.load(f)
    assert sorted(fields) == sorted(
        ["name", "pid", "start", "key", "mesh", "host_mesh", "console", "host", "curve", "job", "routes", "run"])
    assert os.listdir(runtime_dir) == ["monarch-mesh-keepme.json"], "the temporary file stayed"


def test_writing_again_replaces_the_record():
    record().write()
    newer = record()
    newer.console = "consoles-2"
    newer.write()
    assert records.read("keepme").console == "consoles-2"


def test_a_missing_record_is_none_and_an_unreadable_one_a_dead_host(runtime_dir):
    assert records.read("nobody") is None  # (and the runtime directory now exists, 0700)
    (runtime_dir / "monarch-mesh-broken.json").write_text("{not json")
    (runtime_dir / "monarch-mesh-partial.json").write_text(json.dumps({"name": "partial"}))
    for name in ("broken", "partial"):
        rec = records.read(name)
        assert rec == Record(name, 0, None, "", [], [], "", "")
        assert not rec.alive()


def test_alive_means_the_same_process_not_just_the_same_pid():
    assert record().alive()
    reused = record()
    reused.start = records.start_time(os.getpid()) + 1  # the pid now belongs to a later process
    assert not reused.alive()
    unknown_start = record()
    unknown_start.start = None  # an older record without a start time: the pid decides
    assert unknown_start.alive()


def test_an_exited_host_is_not_alive():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started = records.start_time(child.pid)
    child.wait()
    rec = record(pid=child.pid)
    rec.start = started
    assert records.start_time(child.pid) is None and not rec.alive()
    assert not record(pid=0).alive() and not record(pid=-5).alive()


def test_forget_removes_the_record_and_its_log():
    record().write()
    with open(records.log_path("keepme"), "w") as f:
        f.write("host log\n")
    records.forget("keepme")
    assert not os.path.exists(records.info_path("keepme")) and not os.path.exists(records.log_path("keepme"))
    records.forget("keepme")  # forgetting twice is harmless


def test_all_records_lists_every_recorded_mesh_by_name(runtime_dir):
    for name in ("b", "a", "c-1"):
        record(name).write()
    with open(records.log_path("a"), "w") as f:
        f.write("a log is not a record\n")
    assert [r.name for r in records.all_records()] == ["a", "b", "c-1"]


def test_a_runtime_dir_or_record_another_user_made_is_not_trusted(monkeypatch):
    """Another user (uid 65534) made the runtime directory first (JUPYTER_RUNTIME_DIR in a
    shared folder), with a forged record in it: a kernel would attach to their process with
    their key.  Neither the folder nor a record of theirs (nor a link) is used."""
    from support.other_user import as_other_user, needs_other_users, shared_folder

    from monarch_kernel.detached import listing

    needs_other_users()
    forged = json.dumps({**record("evil").__dict__, "key": "cd" * 32})
    with shared_folder() as shared:
        theirs = os.path.join(shared, "runtime")
        as_other_user(f"import os; os.mkdir({theirs!r}, 0o777); os.chmod({theirs!r}, 0o777)\n"
                      f"fd = os.open({theirs!r} + '/monarch-mesh-evil.json', os.O_WRONLY | os.O_CREAT, 0o600)\n"
                      f"os.write(fd, {forged!r}.encode())")
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", theirs)
        with pytest.raises(PermissionError, match="folder of uid 65534"):
            records.all_records()
        # In a runtime dir of the user's own, a note that is a link is not followed.
        mine = os.path.join(shared, "mine")
        monkeypatch.setenv("JUPYTER_RUNTIME_DIR", mine)
        records.runtime_dir()
        os.symlink(os.path.join(theirs, "monarch-mesh-evil.json"), os.path.join(mine, "monarch-mesh-evil.json"))
        assert [r.key for r in records.all_records()] == [""]  # read as a dead host, its key never taken
        listing.mark_attached("keepme")
        note = os.path.join(mine, f"{listing.ATTACHED_PREFIX}keepme.json")
        assert oct(os.stat(note).st_mode & 0o777) == "0o600"
