"""Folders and files of the user's alone, against another local user (uid 65534) who made
something first at the path: a folder of theirs, a link, a FIFO, a key file of theirs.  Key
files are read only once they are checked; a FIFO at the key path must not hang anyone."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from support.other_user import as_other_user, needs_other_users, shared_folder

from monarch_kernel.agent.worker_key import KeyFileError, new_key_file, read_key_file

pytestmark = pytest.mark.timeout(120)

KEY_TEXT = "monarch-kernel-key-1 " + "ab" * 32 + "\n"


@pytest.fixture
def shared():
    needs_other_users()
    with shared_folder() as path:
        yield path


def test_a_key_file_of_another_users_is_refused(shared):
    path = os.path.join(shared, "worker.key")
    as_other_user(f"import os; fd = os.open({path!r}, os.O_WRONLY | os.O_CREAT, 0o600); "
                  f"os.write(fd, {KEY_TEXT!r}.encode())")
    with pytest.raises(KeyFileError, match="belongs to uid 65534"):
        read_key_file(path)


def test_a_link_at_the_key_path_is_refused(shared, tmp_path):
    mine = new_key_file(str(tmp_path / "mine.key"))
    path = os.path.join(shared, "worker.key")
    as_other_user(f"import os; os.symlink({mine!r}, {path!r})")
    with pytest.raises(KeyFileError, match="is a symbolic link"):
        read_key_file(path)


def test_a_fifo_at_the_key_path_hangs_neither_the_worker_nor_the_controller(shared):
    path = os.path.join(shared, "worker.key")
    as_other_user(f"import os; os.mkfifo({path!r}, 0o666)")
    read = subprocess.run([sys.executable, "-c", "from monarch_kernel.agent.worker_key import read_key_file\n"
                           f"read_key_file({path!r})"], capture_output=True, text=True, timeout=30)
    assert read.returncode == 1 and "not a regular file" in read.stderr, read.stderr
    worker = subprocess.run([sys.executable, "-m", "monarch_kernel.agent", "--listen", "tcp://127.0.0.1:0",
                             "--key-file", path], capture_output=True, text=True, timeout=30)
    assert worker.returncode == 2 and "not a regular file" in worker.stderr, worker.stderr


def test_a_folder_another_user_made_is_refused_and_a_loose_one_of_ours_is_made_private(shared):
    from monarch_kernel.runtime import private_files

    theirs = os.path.join(shared, "theirs")
    as_other_user(f"import os; os.mkdir({theirs!r}); os.chmod({theirs!r}, 0o777)")
    with pytest.raises(private_files.NotPrivate, match="folder of uid 65534"):
        private_files.private_dir(theirs)
    link = os.path.join(shared, "link")
    as_other_user(f"import os; os.symlink('/root', {link!r})")
    with pytest.raises(private_files.NotPrivate, match="is a link of uid 65534"):
        private_files.private_dir(link)
    mine = os.path.join(shared, "mine")
    os.mkdir(mine, 0o755)
    assert private_files.private_dir(mine) == mine and stat.S_IMODE(os.stat(mine).st_mode) == 0o700


def test_a_parent_another_user_may_write_is_refused(shared):
    from monarch_kernel.runtime import private_files

    parent = os.path.join(shared, "open")
    as_other_user(f"import os; os.mkdir({parent!r}); os.chmod({parent!r}, 0o777)")
    with pytest.raises(private_files.NotPrivate, match="belongs to uid 65534"):
        private_files.private_dir(os.path.join(parent, "cache"))
