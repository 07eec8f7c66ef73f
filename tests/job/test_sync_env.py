"""``SSHJob(sync_env=...)``: a host whose sshd sees this controller's environment (the .venv's
site-packages, this checkout, every other sys.path folder) as empty folders gets it from the
controller over ssh, once; a second job sends nothing; a changed package is all a third sends.
A host that shares our files is left alone; another Python minor, or too little disk, is a
clear error before anything is sent."""

from __future__ import annotations

import os
import shutil
import sys
import time

import pytest

from monarch_kernel import Actor, endpoint
from monarch_kernel.job import SSHJob
from monarch_kernel.job.env_sync import EnvSyncError

pytestmark = pytest.mark.timeout(300)
HOST_PYTHON = "/usr/bin/python3"  # not the controller's interpreter: the host's own, same minor


class Where(Actor):
    @endpoint
    def files(self) -> dict:
        import mk_sync_probe  # type: ignore[import-not-found]
        import msgpack

        import monarch_kernel
        return {"monarch_kernel": monarch_kernel.__file__, "msgpack": msgpack.__file__,
                "probe": mk_sync_probe.VALUE, "python": sys.executable}


def _probe_package(folder) -> str:
    pkg = folder / "mk_sync_probe"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 1\n")
    return str(folder)


def _run(hosts, cache: str) -> tuple[SSHJob, dict]:
    job = SSHJob(python_exe=HOST_PYTHON, ssh_args=hosts.ssh_args, sync_env=cache)
    job.add_mesh("workers", hosts.hosts)
    try:
        procs = job.state().workers.spawn_procs(per_host={"gpus": 1})
        got = procs.spawn("where", Where).files.call_one().get(timeout=60)
        procs.stop().get(timeout=30)
    finally:
        job.kill()
    return job, got


def test_a_bare_host_gets_the_environment_once_then_only_what_changed(ssh_bare_hosts, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(_probe_package(tmp_path / "extra"))  # a small package, changed below
    cache = str(tmp_path / "cache")
    hosts = ssh_bare_hosts
    host = hosts.hosts[0]
    bare = hosts.ssh(host, f"{HOST_PYTHON} -c 'import monarch_kernel'")
    assert "No module named 'monarch_kernel'" in bare.stderr  # the host really lacks it
    small = tmp_path / "small"
    small.mkdir()
    assert hosts.in_host(host, f"mount -t tmpfs -o size=4m tmpfs {small}").returncode == 0  # there only
    job = SSHJob(python_exe=HOST_PYTHON, ssh_args=hosts.ssh_args, sync_env=str(small / "cache"))
    job.add_mesh("m", [host])
    t = time.monotonic()
    with pytest.raises(EnvSyncError, match=rf"{host} has 0\.00 GiB free in {small}/cache, and this environment "
                                           r"needs .* GiB more .*: free space there, or pass sync_env="):
        job.state()
    assert time.monotonic() - t < 30 and not job.active
    try:
        job, got = _run(hosts, cache)
        first = job.env_syncs[host]
        assert got["monarch_kernel"].startswith(cache) and got["msgpack"].startswith(cache)
        assert got["python"].startswith(cache) and got["probe"] == 1
        assert first.bytes_sent > 1 << 20 and "mk_sync_probe" in first.sent
        job, got = _run(hosts, cache)
        second = job.env_syncs[host]
        assert second.sent == [] and second.bytes_sent == 0
        assert second.seconds < 10
        (tmp_path / "extra" / "mk_sync_probe" / "__init__.py").write_text("VALUE = 2\n")
        job, got = _run(hosts, cache)
        third = job.env_syncs[host]
        assert third.sent == ["mk_sync_probe"] and got["probe"] == 2
        print(f"\nfirst sync: {first.bytes_sent / 2**20:.0f} MiB in {first.seconds:.1f} s; "
              f"second: {second.bytes_sent} B in {second.seconds:.1f} s; "
              f"third: {third.bytes_sent} B in {third.seconds:.1f} s")
    finally:
        hosts.in_host(host, f"umount {small}")
        shutil.rmtree(cache, ignore_errors=True)  # the same file system: not through the host
        report = hosts.check_clean()
        assert not report, report


@pytest.mark.timeout(180)  # both sides read every file of the environment (1.7 GB here) to compare
def test_a_host_sharing_our_files_is_left_alone(ssh_hosts, tmp_path):
    job = SSHJob(python_exe=sys.executable, ssh_args=ssh_hosts.ssh_args, sync_env=str(tmp_path / "cache"))
    job.add_mesh("workers", ssh_hosts.hosts)
    try:
        procs = job.state().workers.spawn_procs(per_host={"gpus": 1})
        procs.stop().get(timeout=30)
        assert all(e.shared and e.bytes_sent == 0 and e.python == sys.executable and e.pythonpath
                   for e in job.env_syncs.values())
        assert not os.path.exists(tmp_path / "cache")
    finally:
        job.kill()


@pytest.mark.timeout(60)
def test_another_python_is_a_clear_error(ssh_hosts, tmp_path):
    host = ssh_hosts.hosts[0]
    other = "/root/.pyenv/versions/3.10.13/bin/python3"
    if not os.path.exists(other) or sys.version_info[:2] == (3, 10):
        pytest.skip(f"needs {other}, a Python of another minor version")
    job = SSHJob(python_exe=other, ssh_args=ssh_hosts.ssh_args, sync_env=True)
    job.add_mesh("m", [host])
    mine = f"{sys.version_info[0]}.{sys.version_info[1]}"
    with pytest.raises(EnvSyncError, match=rf"the Python on {host} .* is 3\.10, this controller's is {mine}.*"
                                           rf"pass python_exe= a Python {mine}"):
        job.state()


def _project(folder, value: str):
    pkg = folder / "mk_planted"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"VALUE = {value!r}\n")
    return pkg


@pytest.mark.timeout(120)
def test_look_alike_files_with_planted_bytecode_are_not_taken_for_a_shared_file_system(tmp_path):
    """A host whose folder at the controller's path holds files of the same names, sizes and
    mtimes but other bytes, and a planted ``__pycache__`` (another user's, uid 65534): the
    host is not "shared" (before, it was, and the planted bytecode ran); the controller's
    units go to its cache instead.  The host is this machine seen through a mount namespace
    of its own, where the look-alike folder is mounted over the controller's."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to give a host its own view of a folder")
    from monarch_kernel.job import env_host
    from monarch_kernel.job.env_sync import LocalEnv, sync_host

    mine = _project(tmp_path / "mine", "ours")
    theirs = _project(tmp_path / "theirs", "evil")  # the same length
    shutil.copystat(mine / "__init__.py", theirs / "__init__.py")
    (theirs / "__pycache__").mkdir()
    tag = sys.implementation.cache_tag
    (theirs / "__pycache__" / f"__init__.{tag}.pyc").write_bytes(b"planted bytecode")
    os.system(f"chown -R 65534:65534 {tmp_path / 'theirs'}")
    scanned = env_host.scan_roots([[str(tmp_path / "mine"), "source", None]])
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    env = LocalEnv(version, scanned, env_host.env_key(version, scanned))

    def there(_host: str, argv: list[str]) -> list[str]:  # the host: its own view of our folder
        return ["unshare", "-m", "--propagation", "private", "sh", "-c",
                f'mount --bind {tmp_path / "theirs"} {tmp_path / "mine"} && exec "$@"', "sh", *argv]

    def here(_host: str, argv: list[str]) -> list[str]:
        return argv

    cache = str(tmp_path / "cache")
    shared = sync_host("same", env, here, sys.executable, cache)
    assert shared.shared and shared.pythonpath == str(tmp_path / "mine")
    (mine / "__pycache__").mkdir()  # bytecode counts: only the same bytes are shared
    (mine / "__pycache__" / f"__init__.{tag}.pyc").write_bytes(b"our bytecode....")
    got = sync_host("look-alike", env, there, sys.executable, cache)
    assert not got.shared and got.sent == ["mk_planted"] and got.python.startswith(cache), got


def test_a_cache_under_a_folder_another_user_may_change_is_refused():
    """``sync_env="/a/folder"`` under a parent another user (uid 65534) owns: they could swap
    the cache (0700 and the user's, as checked) for one of theirs between the probe and the
    agent's start, and their ``python`` would run.  Refused before anything is put there."""
    from support.other_user import as_other_user, needs_other_users, shared_folder

    from monarch_kernel.job import env_host

    needs_other_users()
    with shared_folder() as shared:
        parent = os.path.join(shared, "theirs")
        as_other_user(f"import os; os.mkdir({parent!r}); os.chmod({parent!r}, 0o777)")
        cache = os.path.join(parent, "cache")
        with pytest.raises(PermissionError, match=r"theirs, above the sync_env cache .*\(owner uid 65534"):
            env_host.cache_dir(cache)
        # A cache of the user's own, under folders only they (or root) may change, is taken.
        mine = os.path.join(shared, "mine", "cache")
        os.makedirs(os.path.dirname(mine), 0o755)
        assert env_host.cache_dir(mine) == mine and sorted(os.listdir(mine)) == ["envs", "units"]
