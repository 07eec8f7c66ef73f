"""The ``monarch-kernel`` console script, as installed beside this interpreter (``make test``
installs the project): the CLI tests run it in a subprocess, as a user types it."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(sys.executable), "monarch-kernel")


def command(*args: str) -> list[str]:
    """The argv that runs ``monarch-kernel ARGS``."""
    if not os.access(SCRIPT, os.X_OK):
        raise RuntimeError(f"no console script at {SCRIPT}: install the project into this environment "
                           "(make test does: pip install -e '.[test]')")
    return [SCRIPT, *args]


def cli(*args: str, env: dict | None = None, stdin: str | None = None, timeout: float = 120):
    """``monarch-kernel ARGS`` to its end: (exit code, stdout, stderr)."""
    r = subprocess.run(command(*args), capture_output=True, text=True, env=env, input=stdin, timeout=timeout,
                       stdin=None if stdin is not None else subprocess.DEVNULL)
    return r.returncode, r.stdout, r.stderr
