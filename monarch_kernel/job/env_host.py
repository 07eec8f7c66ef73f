"""The host's half of ``sync_env``: a per-user cache of the controller's environment, in units.

This file runs on hosts that lack the notebook's packages: the controller sends its source as
``python -c`` over the job's own connection (ssh, srun), so it uses the standard library only
and imports nothing of monarch_kernel.  The controller imports it too, for ``scan_roots``: both
sides must name a unit the same way.  A unit is one distribution (its RECORD's files) or one
top-level package of a source folder, keyed by its files' names, sizes and mtimes; units sit in
``<cache>/units/<key>`` and an environment is a venv in ``<cache>/envs/<key>`` whose roots are
hard links into them.  A host "shares" the controller's environment only when the contents of
every file under its units' folders, ``__pycache__`` and dot-files included, hash the same on
both sides (``content_digest``): names, sizes and mtimes are easy to copy.  It never downloads
anything.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile

SKIPPED = ("__pycache__",)
PTH = "monarch-kernel-env.pth"


def _walk(root: str, top: str) -> list[list]:
    """[rel, size, mtime_ns, executable] of the regular files under ``root/top`` (bytecode,
    dot-names and nested venvs left out)."""
    out = []
    path = os.path.join(root, top)
    if os.path.isfile(path):
        st = os.stat(path)
        return [[top, st.st_size, st.st_mtime_ns, bool(st.st_mode & 0o100)]]
    for folder, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED
                         and not os.path.exists(os.path.join(folder, d, "pyvenv.cfg")))
        for name in sorted(names):
            if name.startswith(".") or name.endswith((".pyc", ".pyo")):
                continue
            full = os.path.join(folder, name)
            with contextlib.suppress(OSError):
                st = os.stat(full)
                if stat.S_ISREG(st.st_mode):
                    out.append([os.path.relpath(full, root), st.st_size, st.st_mtime_ns, bool(st.st_mode & 0o100)])
    return out


def _record_files(root: str, info: str) -> list[list]:
    """The files a ``*.dist-info`` lists in its RECORD, inside ``root``, as ``_walk`` gives them."""
    out, seen = [], set()
    try:
        with open(os.path.join(root, info, "RECORD"), encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return _walk(root, info)
    for line in lines:
        rel = os.path.normpath(line.rsplit(",", 2)[0]) if line else ""
        if not rel or rel.startswith("..") or os.path.isabs(rel) or "__pycache__" in rel.split(os.sep) \
                or rel.endswith(".pyc") or rel in seen:
            continue
        seen.add(rel)
        with contextlib.suppress(OSError):
            st = os.stat(os.path.join(root, rel))
            if stat.S_ISREG(st.st_mode):
                out.append([rel, st.st_size, st.st_mtime_ns, bool(st.st_mode & 0o100)])
    return out


def _unit(name: str, files: list[list]) -> dict:
    files = sorted(files)
    key = hashlib.sha256(json.dumps([name, files]).encode()).hexdigest()[:24]
    return {"name": name, "key": key, "files": files, "size": sum(f[1] for f in files)}


def scan_roots(roots: list[list]) -> list[dict]:
    """``roots``: [path, kind, only] per sys.path folder, in order; kind "site" (a
    site-packages: one unit per distribution, one per file or folder no distribution owns) or
    "source" (one unit per top-level package or module; ``only``: just those names)."""
    out = []
    for path, kind, only in roots:
        units = []
        names = sorted(os.listdir(path)) if os.path.isdir(path) else []
        if kind == "site":
            owned: set[str] = set()
            for info in (n for n in names if n.endswith(".dist-info")):
                files = _record_files(path, info)
                owned.update(f[0].split(os.sep)[0] for f in files)
                owned.add(info)
                units.append(_unit(info, files))
            for name in names:
                if name not in owned and name not in SKIPPED and not name.startswith(".") \
                        and not name.endswith(".dist-info"):
                    units.append(_unit(name, _walk(path, name)))
        else:
            for name in names:
                if only is not None and name not in only:
                    continue
                full = os.path.join(path, name)
                package = os.path.isfile(os.path.join(full, "__init__.py"))
                module = os.path.isfile(full) and name.endswith((".py", ".so")) and name != "setup.py"
                if not name.startswith(".") and (package or module):
                    units.append(_unit(name, _walk(path, name)))
        out.append({"path": path, "kind": kind, "units": units})
    return out


def content_digest(scanned: list[dict]) -> str:
    """A hash of the contents of every regular file under the folders and files the units of
    ``scanned`` (``scan_roots``) name at the top of their roots, bytecode and dot-names
    included; what it read is named by its path, so a planted file changes it too."""
    named: list[tuple[str, str]] = []  # (what the hash names it by, the file)
    for root in scanned:
        path = root["path"]
        tops = sorted({f[0].split(os.sep)[0] for u in root["units"] for f in u["files"]}
                      | {u["name"] for u in root["units"]})
        named.append((json.dumps(["root", path]), ""))
        for top in tops:
            full = os.path.join(path, top)
            files = [full] if not os.path.isdir(full) or os.path.islink(full) else sorted(
                os.path.join(folder, n) for folder, dirs, names in os.walk(full)
                for n in names + [d for d in dirs if os.path.islink(os.path.join(folder, d))])
            named += [(json.dumps(["file", os.path.relpath(f, path)]), f) for f in files]
    h = hashlib.sha256()
    with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:  # hashlib lets go of the GIL
        for (name, _f), digest in zip(named, pool.map(_entry_digest, [f for _n, f in named]), strict=True):
            h.update(name.encode())
            h.update(digest)
    return h.hexdigest()


def _entry_digest(path: str) -> bytes:
    """A file's contents' digest; a link's target; nothing for anything else (or a root)."""
    if not path:
        return b""
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return b"link:" + os.readlink(path).encode(errors="surrogateescape")
        return _file_digest(path) if stat.S_ISREG(st.st_mode) else b""
    except OSError as e:
        return f"error:{e.errno}".encode()


def _file_digest(path: str) -> bytes:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.digest()


def env_key(version: str, scanned: list[dict]) -> str:
    body = [version] + [[r["kind"], [u["key"] for u in r["units"]]] for r in scanned]
    return hashlib.sha256(json.dumps(body).encode()).hexdigest()[:24]


# ------------------------------------------------------------------ on the host


def cache_dir(given: str | None) -> str:
    """The cache, made private (0700) to this user: ``given`` (``sync_env="/a/folder"``), or
    ``$XDG_CACHE_HOME/monarch-kernel/env``.  Its parents must be this user's or root's and not
    writable by others (but for a sticky /tmp): whoever may write one could swap the cache
    between the probe and the agent's start.  (``runtime/private_files.py`` checks the same;
    this file may import nothing of monarch_kernel.)"""
    path = given or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "monarch-kernel", "env")
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, 0o700, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private directory of this user (owner uid {st.st_uid}, mode "
                              f"{stat.filemode(st.st_mode)}); remove it, or pass sync_env= another folder")
    here = os.path.dirname(path)
    while True:
        st = os.stat(here)
        if st.st_uid not in (0, os.getuid()) or st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise PermissionError(f"{here}, above the sync_env cache {path}, may be changed by another user (owner "
                                  f"uid {st.st_uid}, mode {stat.filemode(st.st_mode)}), who could swap the cache; "
                                  f"pass sync_env= a folder under one only you (or root) may write")
        if os.path.dirname(here) == here:
            break
        here = os.path.dirname(here)
    for sub in ("units", "envs"):
        os.makedirs(os.path.join(path, sub), 0o700, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(cache: str):
    """Held while units are added or an environment is built: controllers may sync at once."""
    fd = os.open(os.path.join(cache, "lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _version() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def probe(spec: dict) -> dict:
    """What this host has: its Python, the digest of the controller's environment as this host
    sees it (where it may share it: the controller compares), the units its cache holds, and
    the free space there."""
    out: dict = {"version": _version(), "python": sys.executable}
    if out["version"] != spec["version"]:
        return out
    local = scan_roots([[r["path"], r["kind"], r["only"]] for r in spec["roots"]])
    if spec.get("digest", True) and env_key(spec["version"], local) == spec["key"]:
        out["digest"] = content_digest(local)  # the same names, sizes, mtimes: the same bytes? (the controller says)
        return out
    cache = cache_dir(spec.get("cache"))
    ready = os.path.join(cache, "envs", spec["key"], "ready")
    out["cache"] = cache
    out["ready"] = os.path.exists(ready)
    out["have"] = sorted(os.listdir(os.path.join(cache, "units")))
    out["free"] = shutil.disk_usage(cache).free
    return out


def receive(spec: dict, stream) -> dict:
    """Unpack the missing units from ``stream`` (a tar whose members are ``<key>/<rel>``),
    then build the environment's venv; returns its Python."""
    cache = cache_dir(spec.get("cache"))
    units = os.path.join(cache, "units")
    with _locked(cache):
        staging = tempfile.mkdtemp(prefix=".partial-", dir=units)
        try:
            with tarfile.open(fileobj=stream, mode="r|") as tar:
                for member in tar:
                    if not (member.isfile() or member.isdir()):
                        continue
                    safe: dict = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # 3.11.4+
                    tar.extract(member, staging, set_attrs=True, **safe)
            for key in os.listdir(staging):
                dest = os.path.join(units, key)
                if not os.path.exists(dest):
                    os.rename(os.path.join(staging, key), dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return {"python": _build(cache, spec)}


def _build(cache: str, spec: dict) -> str:
    """The environment's venv (made once): its roots are hard links to the units' files, and
    a .pth puts them on its path in the controller's order."""
    env = os.path.join(cache, "envs", spec["key"])
    python = os.path.join(env, "venv", "bin", "python")
    if os.path.exists(os.path.join(env, "ready")):
        return python
    shutil.rmtree(env, ignore_errors=True)
    os.makedirs(env, 0o700)
    lines = []
    for i, root in enumerate(spec["roots"]):
        folder = os.path.join(env, f"root{i}")
        os.makedirs(folder)
        for key in root["units"]:
            unit = os.path.join(cache, "units", key)
            for parent, _dirs, names in os.walk(unit):
                for name in names:
                    src = os.path.join(parent, name)
                    dst = os.path.join(folder, os.path.relpath(src, unit))
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    with contextlib.suppress(FileExistsError):
                        try:
                            os.link(src, dst)
                        except OSError:
                            shutil.copy2(src, dst)
        lines.append(f"import site; site.addsitedir({folder!r})" if root["kind"] == "site" else folder)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", os.path.join(env, "venv")], check=True,
                   stdout=subprocess.DEVNULL)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, PTH), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(env, "ready"), "w") as f:
        f.write(python + "\n")
    return python


def main(argv: list[str]) -> int:
    """``probe SPEC`` or ``receive SPEC`` (the tar on stdin); one JSON line on stdout."""
    what, spec = argv[0], json.loads(argv[1])
    try:
        got = probe(spec) if what == "probe" else receive(spec, sys.stdin.buffer)
    except (OSError, subprocess.CalledProcessError, tarfile.TarError) as e:
        got = {"error": f"{type(e).__name__}: {e}"}
    sys.stdout.write("mk-env " + json.dumps(got) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
