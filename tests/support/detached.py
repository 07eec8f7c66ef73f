"""A detached mesh started as ``%mesh spawn --detach`` starts its host process, with no
kernel: its record appears in ``JUPYTER_RUNTIME_DIR`` (of ``env``) once its ranks are up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def start_detached_host(name: str, env: dict, log: Path, ranks: int = 1, wait: float = 60) -> subprocess.Popen:
    """The host process of detached mesh ``name`` of ``ranks`` ranks, its output in ``log``;
    returns once its record is written (``wait`` seconds at most)."""
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-c", "from monarch_kernel.detached.host import main; main()",
                                 name, str(ranks)], stdin=subprocess.PIPE, stdout=out, stderr=out, env=env,
                                start_new_session=True)
    assert proc.stdin is not None
    proc.stdin.write((json.dumps({"env": {}, "job": None}) + "\n").encode())
    proc.stdin.close()
    record = Path(env.get("JUPYTER_RUNTIME_DIR") or os.environ["JUPYTER_RUNTIME_DIR"]) / f"monarch-mesh-{name}.json"
    deadline = time.monotonic() + wait
    while not record.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the host of detached mesh {name!r} exited {proc.returncode}: {log.read_text()}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            raise AssertionError(f"timed out after {wait:g} s waiting for detached mesh {name!r}'s record")
        time.sleep(0.05)
    return proc


def end(proc: subprocess.Popen) -> None:
    """Kill a host process the test did not stop (its ranks end with it)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
