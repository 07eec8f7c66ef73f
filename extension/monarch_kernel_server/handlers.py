"""The handlers of ``/monarch/meshes``: reading detached meshes' records, and stopping or
attaching one through a helper process or the kernel that should have it.  Every wait is
bounded; a failure answers JSON that says what went wrong, quoting what the request gave
only cut short (``shown``): no answer echoes unbounded input."""

from __future__ import annotations

import asyncio
import json
import re
import sys

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from monarch_kernel.detached import listing, records
from monarch_kernel.runtime import config, rejects

HELPER = [sys.executable, "-m", "monarch_kernel.detached.listing"]
HELPER_TIMEOUT_S = config.seconds("server_helper_timeout")
KERNEL_TIMEOUT_S = config.seconds("server_kernel_timeout")
MAX_BODY = 4096  # bytes of an attach request's body ({"kernel_id": ID} needs under 100)
MAX_KERNEL_ID = 64  # Jupyter's kernel ids are UUIDs (36 characters)
# What Jupyter Server's own routes take as a kernel id (its ``_kernel_id_regex``), bounded.
KERNEL_ID = re.compile(r"[0-9A-Za-z_]+(?:-[0-9A-Za-z_]+){4}")
SHOWN = 80  # characters of a name or id an answer quotes
SAID = 2000  # characters of what a helper or kernel said that an answer passes on


def shown(value: str) -> str:
    """``value`` quoted for an answer, cut short when long (a request's path or body is the user's)."""
    if len(value) <= SHOWN:
        return repr(value)
    return f"{value[:SHOWN - 20]!r}... ({len(value)} characters)"


def said(text: str) -> str:
    """What a helper or a kernel said, for an answer: cut short when long (it may quote the request)."""
    return text if len(text) <= SAID else f"{text[:SAID]}... ({len(text)} characters)"


async def run_helper(*args: str, timeout: float = HELPER_TIMEOUT_S) -> tuple[int, dict]:
    """Run ``python -m monarch_kernel.detached.listing ARGS``; (exit status, its JSON)."""
    proc = await asyncio.create_subprocess_exec(*HELPER, *args, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise web.HTTPError(504, f"the helper ({said(' '.join(args))}) did not finish within {timeout:g} s") from None
    lines = out.decode(errors="replace").strip().splitlines()
    try:
        return proc.returncode or 0, json.loads(lines[-1]) if lines else {}
    except ValueError:
        tail = err.decode(errors="replace").strip().splitlines()[-3:]
        raise web.HTTPError(500, said(f"the helper ({' '.join(args)}) failed: {' | '.join(tail)}")) from None


def attach_kernel_id(body: bytes) -> str:
    """The kernel id an attach request's body names (``{"kernel_id": "..."}``); ValueError,
    saying what the body must be (and quoting none of it whole), for anything else."""
    if len(body) > MAX_BODY:
        raise ValueError(f'the body is {{"kernel_id": "..."}}, at most {MAX_BODY} bytes; this one has {len(body)}')
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        raise ValueError('the body is JSON: {"kernel_id": "..."}') from None
    if not isinstance(data, dict) or not isinstance(data.get("kernel_id"), str) or not data["kernel_id"]:
        raise ValueError('the body names the kernel: {"kernel_id": "..."}')
    kernel_id = data["kernel_id"]
    if len(kernel_id) > MAX_KERNEL_ID or not KERNEL_ID.fullmatch(kernel_id):
        raise ValueError(f"{shown(kernel_id)} is not a kernel id: a kernel's id is a UUID, as Jupyter's "
                         f'/api/kernels lists them: {{"kernel_id": "4f6c2d1e-8a3b-4c5d-9e7f-0a1b2c3d4e5f"}}')
    return kernel_id


class MeshApiHandler(APIHandler):
    def _record(self, name: str) -> records.Record:
        record = listing.find(name)
        if record is None:
            raise web.HTTPError(404, f"no detached mesh named {shown(name)}")
        return record

    async def run_in_kernel(self, kernel_id: str, code: str) -> str:
        """Run ``code`` in kernel ``kernel_id`` (a cell nobody sees; no history); its output,
        or an HTTP error with the kernel's error."""
        if kernel_id not in self.kernel_manager:
            raise web.HTTPError(404, f"no kernel with id {shown(kernel_id)}")
        km = self.kernel_manager.get_kernel(kernel_id)
        client = km.client()
        client.start_channels()
        out: list[str] = []
        error: list[str] = []

        def hook(msg) -> None:
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                error.append(f"{content['ename']}: {content['evalue']}")

        try:
            await client.wait_for_ready(timeout=30)
            reply = await client.execute_interactive(code, store_history=False, timeout=KERNEL_TIMEOUT_S,
                                                     output_hook=hook, allow_stdin=False)
        except TimeoutError:
            raise web.HTTPError(504, f"kernel {shown(kernel_id)} did not finish within {KERNEL_TIMEOUT_S:g} s") \
                from None
        finally:
            client.stop_channels()
        if reply["content"]["status"] != "ok" or error:
            message = "; ".join(error) or reply["content"].get("evalue", "the kernel failed")
            raise web.HTTPError(409, said(re.sub(r"\x1b\[[0-9;]*m", "", message)))
        return "".join(out).strip()


async def with_ranks(found: list[dict], *names: str) -> list[dict]:
    """``found`` (``listing.describe`` of records) with each running mesh's rank pids,
    hosts and dead ranks, asked of its host by a helper (``names``: only those meshes)."""
    if any(m["state"] == "running" for m in found):
        _code, ranks = await run_helper("list", *names)
        for m in found:
            got = ranks.get(m["name"], {})
            m["pids"] = got.get("pids", [])
            m["hosts"] = got.get("hosts") or m["hosts"]
            m["dead"] = got.get("dead", [])
            if "error" in got:
                m["error"] = got["error"]
    return found


class MeshesHandler(MeshApiHandler):
    @web.authenticated
    async def get(self) -> None:
        found = await with_ranks([listing.describe(r) for r in records.all_records()])
        self.finish(json.dumps({"meshes": found}))


class MeshHandler(MeshApiHandler):
    @web.authenticated
    async def get(self, name: str) -> None:
        (found,) = await with_ranks([listing.describe(self._record(name))], name)
        self.finish(json.dumps(found))

    @web.authenticated
    async def delete(self, name: str) -> None:
        record = self._record(name)
        kernel = listing.attached_kernel(name) if record.alive() else None
        if kernel is not None and kernel in self.kernel_manager:
            out = await self.run_in_kernel(kernel, f"%mesh stop {name}")
            message = said(out) or f"stopped detached mesh {shown(name)} (it was attached to kernel {kernel})"
        else:
            code, body = await run_helper("stop", name)
            if code == 2:
                gone = f"no running detached mesh named {shown(name)}"
                raise web.HTTPError(404, said(str(body.get("message", gone))))
            if code != 0:
                raise web.HTTPError(500, said(str(body.get("message", f"stopping {shown(name)} failed"))))
            message = said(str(body.get("message", f"stopped detached mesh {shown(name)}")))
        self.finish(json.dumps({"message": message}))


class AttachHandler(MeshApiHandler):
    @web.authenticated
    async def post(self, name: str) -> None:
        try:
            kernel_id = attach_kernel_id(self.request.body or b"")
        except ValueError as e:
            rejects.count("rest", "malformed", str(e))
            raise web.HTTPError(400, str(e)) from None
        record = self._record(name)
        if not record.alive():
            raise web.HTTPError(409, f"detached mesh {shown(name)} is gone: its host process is no longer running")
        holder = listing.attached_kernel(name)
        if holder is not None and holder != kernel_id and holder in self.kernel_manager:
            raise web.HTTPError(409, f"detached mesh {shown(name)} is attached to kernel {holder}; stop it there, "
                                     "or shut that kernel down, first")
        out = await self.run_in_kernel(kernel_id, f"%mesh attach {name}")
        self.finish(json.dumps({"message": said(out) or f"attached {shown(name)} to kernel {kernel_id}",
                                "kernel": kernel_id}))


def routes(base_url: str = "/") -> list[tuple[str, type[MeshApiHandler]]]:
    """Every route (a URL pattern, its handler) under ``base_url``; docs/reference/rest.md's table
    lists each one's methods, bodies and status codes (tests/system/test_server_api.py compares)."""
    base = url_path_join(base_url, "monarch", "meshes")
    return [
        (base + r"/?", MeshesHandler),
        (base + r"/([^/]+)/attach/?", AttachHandler),
        (base + r"/([^/]+)/?", MeshHandler),
    ]


def setup_handlers(web_app) -> None:
    web_app.add_handlers(".*$", routes(web_app.settings["base_url"]))
