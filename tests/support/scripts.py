"""Controller scripts run as subprocesses, shared by the lifecycle, caller and launcher tests:
each script starts with a line that puts tests/ on its path, so it imports ``support.actors``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELUDE = f"import sys; sys.path.insert(0, {TESTS_DIR!r})\n"


def write_script(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(PRELUDE + textwrap.dedent(body))
    return str(path)


def run_script(path: str, *args, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, path, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def said(proc, word: str) -> str:
    """What a script printed as ``WORD value`` on its stdout (the first such line)."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(word + " "):
            return line.split(" ", 1)[1].strip()
    raise AssertionError(f"the controller exited ({proc.wait()}) without saying {word}")
