"""Bad input where hosts, workers and key files are named: each is refused before anything is
looked up, started or read, with a message that names the argument and shows what to type
(before: ``'NoneType' object is not iterable``, ``UnicodeError ... idna``, ``[Errno 21] Is a
directory: 3``, or a rank's traceback)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from monarch_kernel import attach_to_workers
from monarch_kernel.agent.worker_key import new_key_file
from monarch_kernel.job import SlurmJob, SSHJob

pytestmark = pytest.mark.timeout(60)
LONG = "a" * 10_000
NOT_A_HOST = (r"'a{40}\.\.\. \(10,000 characters\)' is not a host name or address \(a name is at most 253 "
              r"characters")


@pytest.fixture
def key(tmp_path) -> str:
    return new_key_file(str(tmp_path / "worker.key"))


def test_attach_to_workers_without_a_list_says_what_to_pass(key):
    with pytest.raises(TypeError, match=re.escape(
            "workers= is a list of the workers' --listen addresses, e.g. workers=[\"tcp://node1:29500\", "
            "\"tcp://node2:29500\"]; not NoneType")):
        attach_to_workers(workers=None, key=key)


def test_a_host_of_ten_thousand_characters_is_refused_before_any_lookup(key):
    with pytest.raises(ValueError, match=f"a worker's host: {NOT_A_HOST}.*e.g. workers=\\["):
        attach_to_workers(workers=[f"tcp://{LONG}:29500"], key=key)
    with pytest.raises(ValueError, match=f"add_mesh\\('m', ...\\): a host: {NOT_A_HOST}"):
        SSHJob().add_mesh("m", [f"me@{LONG}"])
    with pytest.raises(TypeError, match=r"add_mesh\('m', hosts\): hosts is a list of names ssh reaches, e\.g\. "):
        SSHJob().add_mesh("m", None)
    with pytest.raises(ValueError, match=f"login=: {NOT_A_HOST}.*e.g. login='me@cluster'"):
        SlurmJob(meshes={"m": 1}, login=f"me@{LONG}")
    with pytest.raises(ValueError, match=r"'fe80::1%eth0' is not a host name or address .* an address has no %zone"):
        attach_to_workers(workers=["tcp://[fe80::1%eth0]:29500"], key=key)


def test_a_worker_given_a_long_host_or_a_folder_for_its_key_says_what_to_type(tmp_path, key):
    worker = subprocess.run([sys.executable, "-m", "monarch_kernel.agent", "--listen", f"tcp://{LONG}:0",
                             "--key-file", key], capture_output=True, text=True, timeout=30)
    assert worker.returncode == 2 and re.search(f"monarch_kernel worker: --listen tcp://HOST:0: {NOT_A_HOST}",
                                                worker.stderr), worker.stderr
    assert "Traceback" not in worker.stderr
    worker = subprocess.run([sys.executable, "-m", "monarch_kernel.agent", "--listen", "tcp://127.0.0.1:0",
                             "--key-file", str(tmp_path)], capture_output=True, text=True, timeout=30)
    assert worker.returncode == 2 and worker.stderr.strip() == (
        f"monarch_kernel worker: --key-file {tmp_path} is a folder: give the key file itself, e.g. --key-file "
        f"{tmp_path}/mk.key (make one with  python -m monarch_kernel key new PATH)"), worker.stderr
    with pytest.raises(IsADirectoryError, match=re.escape(f"key={str(tmp_path)!r} is a folder: give the key file "
                                                          f"itself, e.g. key='{tmp_path}/mk.key'")):
        attach_to_workers(workers=["tcp://127.0.0.1:29500"], key=str(tmp_path))


def test_debug_listen_on_a_zoned_loopback_is_refused_before_anything_starts(kc):
    from support.kernels import run

    out, reply = run(kc, "%mesh debug 1 --listen --host ::1%lo")
    assert reply["status"] == "error" and reply["ename"] == "UsageError", out
    assert reply["evalue"].startswith("%mesh debug: --host ::1%lo is not a loopback address.  The debugger "
                                      "listens only on the loopback (127.0.0.1 or ::1)"), reply["evalue"]
