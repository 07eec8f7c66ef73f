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
