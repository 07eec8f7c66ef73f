"""``ProcMesh.sync_workspace`` and ``%mesh sync`` against real rank processes: only changed
files travel, into a per-job copy that the ranks import from (never the controller's own
folder), and changed modules are re-imported in place, without a restart."""

from __future__ import annotations

import hashlib
import importlib
import os
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest
from support.kernels import run, text

from monarch_kernel import Actor, current_rank, endpoint, this_host
from monarch_kernel.actor.code_sync.workspace import scan
from monarch_kernel.actor.errors import WorkspaceReloadError

pytestmark = pytest.mark.timeout(60)


class Probe(Actor):
    """Imports a module on its rank and answers with what it found there."""

    @endpoint
    def call(self, module: str, fn: str):
        return getattr(importlib.import_module(module), fn)()

    @endpoint
    def file_of(self, module: str) -> str:
        return importlib.import_module(module).__file__

    @endpoint
    def importable(self, module: str) -> bool:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            return False
        return True

    @endpoint
    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    @endpoint
    def temp_dir(self) -> str:
        return tempfile.gettempdir()

    @endpoint
    def digest(self, path: str) -> str:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()


def own_temp_dir() -> None:
    """A bootstrap: each rank gets a temp dir of its own, as if each were on a host of its own."""
    path = os.path.join(os.environ["WS_TEST_TEMP"], f"rank{current_rank().rank}")
    os.makedirs(path, exist_ok=True)
    os.environ["TMPDIR"] = path
    tempfile.tempdir = None  # gettempdir() looks again


def write(folder, rel: str, source: str) -> None:
    path = os.path.join(folder, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(textwrap.dedent(source))


def values(vm) -> list:
    return list(vm.get(timeout=20).values())


@pytest.fixture
def procs():
    with this_host().spawn_procs(per_host={"gpus": 2}) as pm:
        yield pm


@pytest.fixture
def ws(tmp_path):
    folder = tmp_path / "ws"
    write(folder, "mymod.py", "def f():\n    return 1\n")
    write(folder, "helper.py", "def h():\n    return 'h'\n")
    return str(folder)


def test_only_changed_files_are_sent_and_reloaded_on_every_rank(procs, ws):
    first = procs.sync_workspace(ws)
    (host,) = first.hosts
    assert host.ranks == [0, 1] and sorted(host.sent) == ["helper.py", "mymod.py"]
    assert (host.deleted, host.unchanged, first.files_sent) == ([], 0, 2)
    probe = procs.spawn("probe", Probe)
    assert values(probe.call.call("mymod", "f")) == [1, 1]

    write(ws, "mymod.py", "def f():\n    return 2\n")  # same size, same second: no stale bytecode
    again = procs.sync_workspace(ws)
    assert again.hosts[0].sent == ["mymod.py"] and again.hosts[0].reloaded == ["mymod"]
    assert values(probe.call.call("mymod", "f")) == [2, 2]

    write(ws, "mymod.py", "def f():\n    return 2\n\ndef g():\n    return 'new'\n")
    added = procs.sync_workspace(ws)
    assert (added.files_sent, added.hosts[0].sent, added.hosts[0].unchanged) == (1, ["mymod.py"], 1)
    assert added.bytes_sent == os.path.getsize(os.path.join(ws, "mymod.py"))
    assert values(probe.call.call("mymod", "g")) == ["new", "new"]  # the same ranks, reloaded in place

    assert values(probe.call.call("helper", "h")) == ["h", "h"]
    os.remove(os.path.join(ws, "helper.py"))
    gone = procs.sync_workspace(ws)
    assert (gone.files_sent, gone.hosts[0].deleted) == (0, ["helper.py"])
    copy = gone.hosts[0].directory
    assert values(probe.exists.call(os.path.join(copy, "helper.py"))) == [False, False]
    assert values(probe.importable.call("helper")) == [False, False]

    same = procs.sync_workspace(ws)
    assert (same.files_sent, same.deleted, same.bytes_sent, same.hosts[0].unchanged) == (0, 0, 0, 1)
    assert same.hosts[0].reloaded == []
    assert "1 host:" in str(same) and "0 sent (0 B), 0 deleted, 1 unchanged" in str(same)


def test_ranks_import_from_the_per_job_copy_not_the_controllers_folder(procs, ws):
    summary = procs.sync_workspace(ws)
    copy = summary.hosts[0].directory
    tmp = values(procs.spawn("probe", Probe).temp_dir.call())[0]
    job = os.path.dirname(copy)
    assert os.path.dirname(job) == tmp and os.path.basename(job).startswith("monarch-workspace-")
    assert stat.S_IMODE(os.stat(job).st_mode) == 0o700
    probe = procs.spawn("probe2", Probe)
    files = values(probe.file_of.call("mymod"))
    assert files == [os.path.join(copy, "mymod.py")] * 2  # both ranks of the host share one copy
    assert not files[0].startswith(ws)
    # The ranks need nothing of the controller's folder: with it gone, they still import.
    os.rename(ws, ws + "-moved")
    assert values(probe.call.call("helper", "h")) == ["h", "h"]


def test_a_package_is_reloaded_after_the_submodules_it_imports(procs, tmp_path):
    ws = str(tmp_path / "src")
    write(ws, "pkg/__init__.py", "from .sub import value\n")
    write(ws, "pkg/sub.py", "def value():\n    return 'old'\n")
    procs.sync_workspace(ws)
    probe = procs.spawn("probe", Probe)
    assert values(probe.call.call("pkg", "value")) == ["old", "old"]
    write(ws, "pkg/sub.py", "def value():\n    return 'new'\n")
    write(ws, "pkg/__init__.py", "from .sub import value  # re-exported\n")
    summary = procs.sync_workspace(ws)
    assert sorted(summary.hosts[0].sent) == ["pkg/__init__.py", "pkg/sub.py"]
    assert summary.hosts[0].reloaded == ["pkg", "pkg.sub"]
    assert values(probe.call.call("pkg", "value")) == ["new", "new"]


def test_an_actor_class_from_a_synced_module_travels_by_reference(procs, tmp_path, monkeypatch):
    ws = str(tmp_path / "lib")
    write(ws, "wsactors.py", """
        import os
        from monarch_kernel import Actor, endpoint

        class Trainer(Actor):
            @endpoint
            def where(self) -> str:
                return os.path.abspath(__file__)
    """)
    monkeypatch.syspath_prepend(ws)  # the controller imports it from the folder itself
    monkeypatch.delitem(sys.modules, "wsactors", raising=False)
    import wsactors

    copy = procs.sync_workspace(ws).hosts[0].directory
    trainers = procs.spawn("trainers", wsactors.Trainer)  # pickled by name: the ranks import it
    assert values(trainers.where.call()) == [os.path.join(copy, "wsactors.py")] * 2
    monkeypatch.delitem(sys.modules, "wsactors")


def test_a_mesh_whose_copy_was_updated_by_another_reloads_without_files(ws):
    with this_host().spawn_procs(per_host={"gpus": 1}) as a, this_host().spawn_procs(per_host={"gpus": 1}) as b:
        a.sync_workspace(ws)
        pa = a.spawn("probe", Probe)
        assert values(pa.call.call("mymod", "f")) == [1]
        write(ws, "mymod.py", "def f():\n    return 'b'\n")
        assert b.sync_workspace(ws).files_sent == 1  # the same job and host: one shared copy
        assert values(pa.call.call("mymod", "f")) == [1]  # a's ranks have not re-imported yet
        caught_up = a.sync_workspace(ws)
        assert caught_up.files_sent == 0 and caught_up.hosts[0].reloaded == ["mymod"]
        assert values(pa.call.call("mymod", "f")) == ["b"]


def test_a_module_that_fails_to_reimport_is_reported_with_its_rank(procs, ws):
    procs.sync_workspace(ws)
    probe = procs.spawn("probe", Probe)
    assert values(probe.call.call("mymod", "f")) == [1, 1]
    write(ws, "mymod.py", "def f(:\n")
    with pytest.raises(WorkspaceReloadError) as info:
        procs.sync_workspace(ws)
    message = str(info.value)
    assert f"synced {ws}, but re-importing failed on the ranks:" in message
    assert "mymod (rank 0): SyntaxError" in message and "mymod (rank 1): SyntaxError" in message
    assert info.value.summary.files_sent == 1
    write(ws, "mymod.py", "def f():\n    return 'fixed'\n")
    assert procs.sync_workspace(ws).hosts[0].reloaded == ["mymod"]
    assert values(probe.call.call("mymod", "f")) == ["fixed", "fixed"]


def test_scan_leaves_out_caches_environments_and_large_files(tmp_path):
    ws = str(tmp_path)
    write(ws, "keep.py", "x = 1\n")
    write(ws, "sub/keep.txt", "data\n")
    for skipped in (".git/HEAD", "__pycache__/keep.cpython-311.pyc", "sub/old.pyc", ".venv/lib/x.py",
                    "env/pyvenv.cfg", "env/lib/y.py", ".hidden", "node_modules/a.js", "data/big.bin"):
        write(ws, skipped, "z")
    with open(os.path.join(ws, "big.bin"), "wb") as f:
        f.write(b"\0" * 2048)
    found = scan(ws, exclude=["data"], max_file_size=1024)
    assert sorted(found.files) == ["keep.py", "sub/keep.txt"]
    assert found.skipped == [("big.bin", "2.0 KiB, over the 1.0 KiB limit (max_file_size=)")]


def test_skipped_files_are_named_in_the_summary_and_stay_home(procs, ws):
    with open(os.path.join(ws, "weights.bin"), "wb") as f:
        f.write(b"\0" * 4096)
    summary = procs.sync_workspace(ws, max_file_size=1024)
    assert sorted(summary.hosts[0].sent) == ["helper.py", "mymod.py"]
    assert "skipped weights.bin: 4.0 KiB, over the 1.0 KiB limit" in str(summary)
    probe = procs.spawn("probe", Probe)
    assert values(probe.exists.call(os.path.join(summary.hosts[0].directory, "weights.bin"))) == [False, False]


def test_another_job_gets_its_own_copy_removed_when_it_ends(procs, ws):
    ours = procs.sync_workspace(ws).hosts[0].directory
    script = textwrap.dedent(f"""
        from monarch_kernel import this_host
        with this_host().spawn_procs(per_host={{"gpus": 1}}) as procs:
            print(procs.sync_workspace({ws!r}).hosts[0].directory, flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=45)
    assert done.returncode == 0, done.stderr
    theirs = done.stdout.strip()
    assert os.path.basename(theirs) == os.path.basename(ours)  # the same folder, synced by two jobs
    assert os.path.dirname(theirs) != os.path.dirname(ours)
    assert not os.path.exists(os.path.dirname(theirs)), "the other job's root left its copies behind"
    assert os.path.exists(ours)


def test_large_totals_travel_in_several_calls_and_arrive_intact(procs, tmp_path, monkeypatch):
    from monarch_kernel.actor.code_sync import workspace

    monkeypatch.setattr(workspace, "CHUNK", 3 << 20)  # a call per 3 MiB (32 MiB normally)
    ws = str(tmp_path / "blobs")
    os.makedirs(ws)
    blobs = {f"part{i}.bin": os.urandom((1 << 20) + i) for i in range(5)}  # over 1 MiB: out-of-band frames
    for name, data in blobs.items():
        with open(os.path.join(ws, name), "wb") as f:
            f.write(data)
    summary = procs.sync_workspace(ws)
    assert sorted(summary.hosts[0].sent) == sorted(blobs)
    assert summary.bytes_sent == sum(len(d) for d in blobs.values())
    probe = procs.spawn("probe", Probe)
    for name, data in blobs.items():
        got = values(probe.digest.call(os.path.join(summary.hosts[0].directory, name)))
        assert got == [hashlib.sha256(data).hexdigest()] * 2, name


def test_ranks_that_share_a_host_name_but_not_a_temp_dir_get_a_copy_each(ws, tmp_path):
    temp = str(tmp_path / "temps")
    with this_host().spawn_procs(per_host={"gpus": 2}, bootstrap=own_temp_dir, env={"WS_TEST_TEMP": temp}) as procs:
        summary = procs.sync_workspace(ws)
        assert [h.ranks for h in summary.hosts] == [[0], [1]]  # one host name, two copies: both are filled
        assert [sorted(h.sent) for h in summary.hosts] == [["helper.py", "mymod.py"]] * 2
        dirs = [h.directory for h in summary.hosts]
        assert [d.startswith(os.path.join(temp, f"rank{r}") + os.sep) for r, d in enumerate(dirs)] == [True, True]
        write(ws, "mymod.py", "def f():\n    return 'both'\n")
        summary = procs.sync_workspace(ws)
        assert [(h.sent, h.reloaded) for h in summary.hosts] == [(["mymod.py"], [])] * 2
        probe = procs.spawn("probe", Probe)
        assert values(probe.call.call("mymod", "f")) == ["both", "both"]
        assert values(probe.file_of.call("mymod")) == [os.path.join(d, "mymod.py") for d in dirs]


def test_dead_ranks_are_left_out_and_the_others_synced(procs, ws):
    procs.kill([0])  # the rank that would have listed the host's copy
    summary = procs.sync_workspace(ws)
    assert summary.dead_ranks == [0] and summary.hosts[0].ranks == [1]
    assert sorted(summary.hosts[0].sent) == ["helper.py", "mymod.py"]
    assert "not reached: [rank 0] (dead)" in str(summary)
    probe = procs.slice(gpus=1).spawn("probe", Probe)
    assert values(probe.call.call("mymod", "f")) == [1]


def test_a_restarted_rank_gets_the_copy_back_without_files_sent(procs, ws):
    procs.sync_workspace(ws)
    procs.kill([1])
    procs.restart([1])
    summary = procs.sync_workspace(ws)
    assert summary.files_sent == 0 and summary.hosts[0].ranks == [0, 1]
    probe = procs.spawn("probe", Probe)
    assert values(probe.file_of.call("mymod")) == [os.path.join(summary.hosts[0].directory, "mymod.py")] * 2


def test_a_path_that_is_not_a_folder_is_refused(procs, tmp_path):
    with pytest.raises(NotADirectoryError, match="sync_workspace takes a folder; .* is not one"):
        procs.sync_workspace(str(tmp_path / "missing"))


@pytest.mark.timeout(120)
def test_mesh_sync_in_a_kernel(kc, tmp_path):
    ws = str(tmp_path / "code")
    write(ws, "mymod.py", "def f():\n    return 'one'\n")
    out, reply = run(kc, "procs = %mesh spawn -n 2")
    assert reply["status"] == "ok", text(out)
    out, reply = run(kc, f"%mesh sync {ws}")
    assert reply["status"] == "ok", text(out)
    assert f"synced {ws} to 1 host:" in text(out) and "[ranks 0-1]" in text(out) and "1 sent" in text(out)
    out, reply = run(kc, "%%mesh\nimport mymod\nmymod.f()")
    assert "[ranks 0-1] 'one'" in text(out), text(out)
    write(ws, "mymod.py", "def f():\n    return 'one'\n\ndef g():\n    return 'two'\n")
    out, reply = run(kc, f"%cd {ws}\n%mesh sync")
    assert "1 sent" in text(out) and "reloaded mymod" in text(out), text(out)
    out, reply = run(kc, "%%mesh\nmymod.g()")
    assert "[ranks 0-1] 'two'" in text(out), text(out)
    out, reply = run(kc, f"%mesh sync {ws}/nothing-here")
    assert reply["status"] == "error"
    assert f"'{ws}/nothing-here' is not a folder; type  %mesh sync [path]" in text(out)


def shared_temp_dir() -> None:
    """A bootstrap: the ranks' temp dir is a shared sticky folder, as /tmp is."""
    os.environ["TMPDIR"] = os.environ["WS_TEST_TEMP"]
    tempfile.tempdir = None  # gettempdir() looks again


def test_another_user_cannot_make_the_copys_folder_first(ws):
    """The copy's folder was named by a digest of the controller's address, which anyone can
    compute (its run directory in /tmp, its pid in ps): another user (uid 65534) made it
    first, and the sync was refused.  Its name now needs the job's key."""
    import hashlib

    from support.other_user import as_other_user, needs_other_users, shared_folder

    from monarch_kernel.runtime import Runtime

    needs_other_users()
    with shared_folder() as temp:
        guessed = os.path.join(temp, "monarch-workspace-" + hashlib.sha256(Runtime.current().address.encode())
                               .hexdigest()[:16])
        as_other_user(f"import os; os.mkdir({guessed!r}); os.chmod({guessed!r}, 0o777)")
        with this_host().spawn_procs(per_host={"gpus": 1}, bootstrap=shared_temp_dir,
                                     env={"WS_TEST_TEMP": temp}) as procs:
            summary = procs.sync_workspace(ws)
            job = os.path.dirname(summary.hosts[0].directory)
            assert os.path.dirname(job) == temp and job != guessed
            assert os.stat(job).st_uid == os.geteuid() and stat.S_IMODE(os.stat(job).st_mode) == 0o700
            assert values(procs.spawn("probe", Probe).call.call("mymod", "f")) == [1]
