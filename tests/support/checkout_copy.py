"""A fresh copy of this tree set up by its own Makefile (``make setup workspace``), as a new
user's clone is by ``make lab``: its own .venv, its own kernelspec, the notebooks copied to
workspace/.  The copy is a git repository of its own (one commit of the tree as it is now), so
a test can ask git what a session left.  apt-get there is a stand-in that records its
arguments and installs nothing: a test never changes the machine's packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILT = ("labextension/prebuilt", "labextension/lib", "labextension/tsconfig.tsbuildinfo")
RECORDING_APT = '#!/bin/sh\necho "$*" >> "$(dirname "$0")/apt-get.log"\n'


def user_env(tools: Path | None = None) -> dict:
    """This process's environment as a user's shell has it: no PYTHONPATH, no virtualenv of the
    tests on PATH (so nothing of the test environment leaks in), ``tools`` first on PATH."""
    env = {k: v for k, v in os.environ.items()  # nor make's own variables, when `make test` runs the tests
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    mine = {os.path.dirname(sys.executable), os.path.join(sys.prefix, "bin")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and p not in mine]
    env["PATH"] = os.pathsep.join(([str(tools)] if tools else []) + path)
    return env


def make(cwd: Path, *args: str, env: dict, timeout: float = 600) -> str:
    p = subprocess.run(["make", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"make {' '.join(args)} exited {p.returncode}:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout + p.stderr


@dataclass
class LabCopy:
    root: Path
    tools: Path  # the stand-in apt-get
    setup_seconds: float = 0.0

    @property
    def venv(self) -> Path:
        return self.root / ".venv"

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def kernel_dirs(self) -> list[str]:
        return [str(self.venv / "share" / "jupyter" / "kernels")]

    def env(self) -> dict:
        return user_env(self.tools)

    def make(self, *args: str, timeout: float = 600) -> str:
        return make(self.root, *args, env=self.env(), timeout=timeout)

    def git_status(self) -> list[str]:
        """What git sees changed or new in the copy (ignored files are not listed)."""
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=self.root,
                             capture_output=True, text=True, check=True).stdout
        return out.splitlines()


def clean_copy(dest: Path, node_modules: bool = True) -> Path:
    """The files of this tree that git does not ignore (tracked or new, as they are now), so
    none of the labextension's build output; ``node_modules``: hard links to this tree's."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    assert not any((dest / b).exists() for b in BUILT), "the copy carries labextension build output"
    if node_modules and (ROOT / "labextension" / "node_modules").is_dir():
        linked = subprocess.run(["cp", "-al", str(ROOT / "labextension" / "node_modules"), str(dest / "labextension")],
                                capture_output=True)
        if linked.returncode != 0:  # another filesystem: the build installs the packages itself
            shutil.rmtree(dest / "labextension" / "node_modules", ignore_errors=True)
    return dest


def panel_up_to_date() -> bool:
    """Whether this checkout's labextension/prebuilt is newer than every source the Makefile
    builds it from (its LABSRC), so that make in the copy will not build it again."""
    ext = ROOT / "labextension"
    built = ext / "prebuilt" / "package.json"
    sources = [*ext.glob("src/*.ts"), *ext.glob("style/*"), *ext.glob("schema/*"),
               *(ext / name for name in ("package.json", "yarn.lock", "tsconfig.json"))]
    return built.exists() and all(p.stat().st_mtime < built.stat().st_mtime for p in sources if p.is_file())


def lab_copy(dest: Path) -> LabCopy:
    """This tree copied to ``dest`` and set up by ``make setup workspace`` there.  The Mesh
    panel's build output is copied (mtimes kept), so make rebuilds it only when its sources
    are newer, as it would in this checkout; only without it does the copy take node_modules
    (23,000 files, hard links) to build it."""
    built = panel_up_to_date()
    clean_copy(dest, node_modules=not built)
    if built:
        shutil.copytree(ROOT / "labextension" / "prebuilt", dest / "labextension" / "prebuilt", symlinks=True)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@localhost"]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "the tree under test"]):
        subprocess.run(git + cmd, cwd=dest, check=True, capture_output=True)
    tools = dest.parent / "tools"
    tools.mkdir()
    (tools / "apt-get").write_text(RECORDING_APT)
    (tools / "apt-get").chmod(0o755)
    lab = LabCopy(dest, tools)
    began = time.monotonic()
    lab.make("setup", "workspace")
    lab.setup_seconds = time.monotonic() - began
    return lab
