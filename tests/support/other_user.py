"""Another local user for security tests: uid 65534 (nobody) running the system's python, and
a shared folder like /tmp where both may make entries."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile

import pytest

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
SYSTEM_PYTHON = "/usr/bin/python3"  # every user can run it; it has no debugpy, no torch


def needs_other_users() -> None:
    """Skip unless this test can run code as another user."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None or not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to run an attacker as another user")


def as_other_user(code: str, timeout: float = 30) -> str:
    """Run ``code`` as uid 65534 with the system's python; its stdout (it must succeed)."""
    ran = subprocess.run([*NOBODY, SYSTEM_PYTHON, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert ran.returncode == 0, ran.stderr
    return ran.stdout


@contextlib.contextmanager
def shared_folder():
    """A folder like /tmp: everyone may make entries in it, the sticky bit keeps them apart."""
    path = tempfile.mkdtemp(prefix="mk-shared-", dir="/tmp")
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
