"""``sync_env=True``: this controller's Python environment, sent to hosts that lack it.

The controller's half.  It lists the folders of ``sys.path`` that are not the standard library
(site-packages, source trees, an editable install's project) as units (``env_host.py``), asks
each host over the job's own connection what it has, and streams only the missing units as a
tar from this machine's files, never from the internet.  Hosts are synced in parallel, each
once; a host that already sees these folders (a shared file system) is left alone.  Compiled
extensions are sent as they are, so hosts must be the same platform.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..runtime.hosting import config
from . import env_host

MARGIN = 256 << 20  # free space a host keeps beyond what the units need
TIMEOUT_S = config.seconds("env_probe_timeout")  # the transfer itself has no deadline (gigabytes take a while)

# (host, remote argv) -> the local argv that runs it there, over the job's connection
Remote = Callable[[str, list[str]], list[str]]


class EnvSyncError(RuntimeError):
    """A host cannot take this controller's environment; the message says why and what to do."""


@dataclass
class HostEnv:
    """What syncing did on one host: ``python`` runs the agent there (the venv in its cache,
    or the given one where the host shares our files, with ``pythonpath`` our sys.path
    folders), ``sent`` units, ``bytes_sent``."""

    host: str
    python: str
    shared: bool = False
    pythonpath: str | None = None
    sent: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    seconds: float = 0.0


def roots() -> list[list]:
    """[path, kind, only] for each folder of ``sys.path`` to send, in order; plus, for a
    package imported from outside them (an editable install's finder), its folder, with only it."""
    stdlib = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
    out: list[list] = []
    seen = set()
    for entry in sys.path:
        path = os.path.realpath(entry) if entry else ""
        if not entry or not os.path.isabs(entry) or not os.path.isdir(path) or path in seen:
            continue
        seen.add(path)
        site = any(n.endswith(".dist-info") for n in os.listdir(path))
        if not site and any(path == s or path.startswith(s + os.sep) for s in stdlib):
            continue
        out.append([path, "site" if site else "source", None])
    for name, module in list(sys.modules.items()):
        f = getattr(module, "__file__", None)
        if "." in name or not isinstance(f, str):
            continue
        where = os.path.dirname(os.path.realpath(f))
        if os.path.basename(f) == "__init__.py":
            where = os.path.dirname(where)
        inside = any(where == r[0] or where.startswith(r[0] + os.sep) for r in out)
        if not inside and not any(where == s or where.startswith(s + os.sep) for s in stdlib):
            out.insert(0, [where, "source", [name if os.path.basename(f) == "__init__.py" else os.path.basename(f)]])
    return out


@dataclass
class LocalEnv:
    """This controller's environment as units: ``spec`` is what the hosts are told."""

    version: str
    scanned: list[dict]
    key: str
    _digest: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def digest(self) -> str:
        """The contents' digest (``env_host.content_digest``), read once, when a host first
        may share these files (they are read after its answer: bytecode is written meanwhile)."""
        with self._lock:
            if self._digest is None:
                self._digest = env_host.content_digest(self.scanned)
            return self._digest

    @classmethod
    def scan(cls) -> LocalEnv:
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"
        scanned = env_host.scan_roots(roots())
        seen: set[str] = set()
        for root in scanned:  # a name an earlier source folder gives is never imported from a later one
            if root["kind"] == "source":
                root["units"] = [u for u in root["units"] if u["name"] not in seen]
            seen.update(u["name"] for u in root["units"] if root["kind"] == "source")
        return cls(version, scanned, env_host.env_key(version, scanned))

    def spec(self, cache: str | None) -> dict:
        return {"version": self.version, "key": self.key, "cache": cache,
                "roots": [{"path": r["path"], "kind": r["kind"], "only": [u["name"] for u in r["units"]]
                           if r["kind"] == "source" else None, "units": [u["key"] for u in r["units"]]}
                          for r in self.scanned]}

    def units(self) -> dict[str, tuple[str, dict]]:
        return {u["key"]: (r["path"], u) for r in self.scanned for u in r["units"]}

    @property
    def size(self) -> int:
        return sum(u["size"] for _p, u in self.units().values())


def _script(what: str, spec: dict, python: str) -> list[str]:
    with open(env_host.__file__, encoding="utf-8") as f:
        source = f.read()
    return [python, "-c", source, what, json.dumps(spec)]


def _answer(host: str, proc: subprocess.CompletedProcess | tuple[int, str, str], python: str) -> dict:
    code, out, err = proc if isinstance(proc, tuple) else (proc.returncode, proc.stdout, proc.stderr)
    for line in out.splitlines():
        if line.startswith("mk-env "):
            got = json.loads(line[len("mk-env "):])
            if "error" in got:
                raise EnvSyncError(f"syncing the environment to {host} failed there: {got['error']}")
            return got
    said = (err or out).strip().splitlines()[-3:]
    if code == 127 or "No such file" in err or "not found" in err:
        raise EnvSyncError(f"{python} was not found on {host}: pass python_exe= the path of a Python "
                           f"{sys.version_info[0]}.{sys.version_info[1]} there")
    raise EnvSyncError(f"could not sync the environment to {host} (exit {code}): " + " / ".join(said))


def _probe(host: str, spec: dict, remote: Remote, python: str, environ: dict | None) -> dict:
    try:
        return _answer(host, subprocess.run(remote(host, _script("probe", spec, python)), capture_output=True,
                                            text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL, env=environ),
                       python)
    except subprocess.TimeoutExpired:
        raise EnvSyncError(f"{host} did not answer the environment probe in {TIMEOUT_S:g} s") from None


def sync_host(host: str, env: LocalEnv, remote: Remote, python: str, cache: str | None,
              environ: dict | None = None) -> HostEnv:
    """Bring ``host``'s cache up to ``env`` (sending only the units it lacks) and say which
    Python runs the agent there."""
    t = time.monotonic()
    spec = env.spec(cache)
    got = _probe(host, spec, remote, python, environ)
    if got["version"] != env.version:
        raise EnvSyncError(
            f"the Python on {host} ({got['python']}) is {got['version']}, this controller's is {env.version}: "
            f"sync_env copies packages built for {env.version}; pass python_exe= a Python {env.version} on "
            f"{host} (e.g. python{env.version})")
    if "digest" in got:
        if got["digest"] == env.digest():  # the same bytes: a shared file system
            return HostEnv(host, python, shared=True, pythonpath=":".join(r["path"] for r in env.scanned),
                           seconds=time.monotonic() - t)
        got = _probe(host, dict(spec, digest=False), remote, python, environ)  # look-alikes: use the cache
    units = env.units()
    missing = [k for k in units if k not in set(got["have"])]
    need = sum(units[k][1]["size"] for k in missing)
    if missing and got["free"] < need + MARGIN:
        raise EnvSyncError(
            f"{host} has {_gib(got['free'])} free in {got['cache']}, and this environment needs {_gib(need)} "
            f"more (plus {_gib(MARGIN)} to spare): free space there, or pass sync_env='/a/folder/with/room'")
    if not missing and got["ready"]:
        return HostEnv(host, os.path.join(got["cache"], "envs", env.key, "venv", "bin", "python"),
                       seconds=time.monotonic() - t)
    with subprocess.Popen(remote(host, _script("receive", spec, python)), stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ) as proc:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        said: dict[str, bytes] = {}
        readers = [threading.Thread(target=lambda n=n, f=f: said.__setitem__(n, f.read()), daemon=True)
                   for n, f in (("out", proc.stdout), ("err", proc.stderr))]
        for r in readers:
            r.start()
        try:
            with tarfile.open(fileobj=proc.stdin, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for key in missing:
                    root, unit = units[key]
                    for rel, *_rest in unit["files"]:
                        tar.add(os.path.join(root, rel), arcname=f"{key}/{rel}", recursive=False)
        except OSError:
            pass  # it ended early: its answer says why
        finally:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        code = proc.wait()
        for r in readers:
            r.join()
    done = _answer(host, (code, said.get("out", b"").decode(errors="replace"),
                          said.get("err", b"").decode(errors="replace")), python)
    return HostEnv(host, done["python"], sent=[units[k][1]["name"] for k in missing], bytes_sent=need,
                   seconds=time.monotonic() - t)


def sync_hosts(hosts: list[str], remote: Remote, python: str, cache: str | None = None,
               env: dict | None = None) -> dict[str, HostEnv]:
    """Sync every host at once (``env``: the environment of the ``remote`` commands); the
    first failure is raised once all are done."""
    local = LocalEnv.scan()
    results: dict[str, HostEnv | BaseException] = {}

    def one(host: str) -> None:
        try:
            results[host] = sync_host(host, local, remote, python, cache, env)
        except BaseException as e:  # noqa: BLE001  (raised below, in the caller's thread)
            results[host] = e

    threads = [threading.Thread(target=one, args=(h,), name=f"monarch-env-{h}", daemon=True) for h in hosts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for h in hosts:
        got = results[h]
        if isinstance(got, BaseException):
            raise got
    return {h: r for h, r in results.items() if isinstance(r, HostEnv)}


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"
