"""The server extension's REST API: the documentation's table of routes (docs/reference/rest.md:
methods, bodies, status codes) is the handlers' own, read from their source, so neither can drift; and
``GET /monarch/meshes/{name}`` answers a real detached mesh's record, or 404, from a real
Jupyter server."""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import time
from pathlib import Path

import pytest
from monarch_kernel_server import handlers
from support.browser import Lab, rest
from support.detached import start_detached_host

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
REST_PAGE = ROOT / "docs" / "reference" / "rest.md"
TABLE = re.compile(r"<!-- REST table: .*? -->\n(.*?)<!-- end of REST table -->", re.S)
METHODS = ("get", "post", "put", "patch", "delete")
# Every route is behind @web.authenticated: Jupyter Server answers 403 without a token.
ALWAYS = {200, 403}


def documented_routes() -> dict[tuple[str, str], set[int]]:
    """(METHOD, path) -> the status codes the documentation's REST table lists for it."""
    found = TABLE.search(REST_PAGE.read_text())
    assert found, f"{REST_PAGE.relative_to(ROOT)} has lost its REST table's markers (see TABLE)"
    rows = [line for line in found.group(1).splitlines() if line.startswith("| `")]
    out = {}
    for row in rows:
        method, path, _body, answers = (cell.strip() for cell in row.strip("|").split("|", 3))
        out[(method.strip("`"), path.strip("`"))] = {int(c) for c in re.findall(r"`(\d{3})`", answers)}
    return out


def _functions() -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    """handlers.py's functions by name: ``f`` at the top level, ``Class.f`` in a class."""
    tree = ast.parse(inspect.getsource(handlers))
    out: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out[f"{node.name}.{item.name}"] = item
    return out


def _owner(cls: type, name: str) -> type | None:
    """The class of handlers.py in ``cls``'s MRO that defines ``name`` (None: tornado's, or none)."""
    return next((k for k in cls.__mro__ if k.__module__ == handlers.__name__ and name in vars(k)), None)


def statuses(cls: type, method: str) -> set[int]:
    """The status codes ``cls.method`` can answer: every ``HTTPError(code, ...)`` in it and in
    the functions and ``self.`` methods of handlers.py it calls, however deep."""
    funcs, seen = _functions(), set()

    def walk(key: str) -> set[int]:
        if key in seen:
            return set()
        seen.add(key)
        codes = set()
        for node in ast.walk(funcs[key]):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if (isinstance(f, ast.Attribute) and f.attr == "HTTPError") or (isinstance(f, ast.Name)
                                                                             and f.id == "HTTPError"):
                assert node.args and isinstance(node.args[0], ast.Constant), f"{key}: a status that is not a literal"
                codes.add(node.args[0].value)
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self":
                owner = _owner(cls, f.attr)
                if owner is not None:
                    codes |= walk(f"{owner.__name__}.{f.attr}")
            elif isinstance(f, ast.Name) and f.id in funcs:
                codes |= walk(f.id)
        return codes

    owner = _owner(cls, method)
    assert owner is not None, f"{cls.__name__} has no {method} of its own"
    return walk(f"{owner.__name__}.{method}")


def handler_routes() -> dict[tuple[str, str], set[int]]:
    """(METHOD, path) -> status codes, from the handlers themselves (``handlers.routes()``)."""
    out = {}
    for pattern, cls in handlers.routes("/"):
        path = pattern.replace("([^/]+)", "{name}").removesuffix("/?")
        for method in METHODS:
            if _owner(cls, method) is not None:
                out[(method.upper(), path)] = ALWAYS | statuses(cls, method)
    return out


def test_the_docs_list_every_route_method_and_status_the_handlers_have():
    documented, served = documented_routes(), handler_routes()
    assert set(documented) == set(served), (
        f"docs/reference/rest.md and handlers.routes() differ: only in the docs "
        f"{sorted(set(documented) - set(served))}, only in the handlers {sorted(set(served) - set(documented))}")
    for route, codes in served.items():
        assert documented[route] == codes, (
            f"{' '.join(route)}: docs/reference/rest.md lists {sorted(documented[route])}, "
            f"the handlers answer {sorted(codes)}")
    # The table is read from the source, not guessed: GET of one mesh is there, with its 404.
    assert served[("GET", "/monarch/meshes/{name}")] == {200, 403, 404, 500, 504}


def test_get_one_mesh_answers_its_record_or_404(tmp_path):
    root, home = tmp_path / "notebooks", tmp_path / "jupyter"
    root.mkdir()
    home.mkdir()
    lab = Lab(root, home)
    host = None
    try:
        lab.start()
        status, body = rest(lab, "/monarch/meshes/nope")
        assert (status, body.get("message")) == (404, "no detached mesh named 'nope'"), (status, body)
        env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(home / "runtime")}
        host = start_detached_host("one", env, tmp_path / "host.log")
        status, one = rest(lab, "/monarch/meshes/one")
        assert status == 200, one
        assert one["name"] == "one" and one["state"] == "running" and one["ranks"] == 1, one
        assert len(one["pids"]) == 1 and one["host_pid"] == host.pid and one["dead"] == [], one
        status, listed = rest(lab, "/monarch/meshes")
        assert status == 200 and listed["meshes"] == [one], listed
        assert rest(lab, "/monarch/meshes/one", token=False)[0] == 403
        status, body = rest(lab, "/monarch/meshes/one", "DELETE")
        assert status == 200, body
        assert host.wait(timeout=30) is not None
        status, body = rest(lab, "/monarch/meshes/one")
        assert (status, body.get("message")) == (404, "no detached mesh named 'one'"), (status, body)
    finally:
        if host is not None and host.poll() is None:
            host.kill()
            host.wait(timeout=10)
        lab.stop()


def test_no_answer_echoes_an_over_long_or_malformed_name_or_kernel_id_whole(tmp_path):
    """A kernel id must be one (a UUID, in a body of at most 4 KiB) or the attach is a 400;
    names and ids are quoted cut short, in every answer that quotes them."""
    root, home = tmp_path / "notebooks", tmp_path / "jupyter"
    root.mkdir()
    home.mkdir()
    lab = Lab(root, home)
    try:
        lab.start()
        huge = "k" * (1 << 20)
        t0 = time.monotonic()
        status, body = rest(lab, "/monarch/meshes/nope/attach", "POST", json.dumps({"kernel_id": huge}).encode())
        assert status == 400 and len(json.dumps(body)) < 1000, (status, str(body)[:300])
        assert "at most 4096 bytes" in body["message"] and huge[:100] not in body["message"]
        assert time.monotonic() - t0 < 30

        for bad in ("x" * 3000, "not a kernel id", "../../etc/passwd", "4f6c2d1e-8a3b-4c5d-9e7f-0a1b2c3d4e5f\n"):
            status, body = rest(lab, "/monarch/meshes/nope/attach", "POST", json.dumps({"kernel_id": bad}).encode())
            assert status == 400 and "is not a kernel id: a kernel's id is a UUID" in body["message"], (status, body)
            assert len(body["message"]) < 300, body

        # A well-formed id passes the check; then the mesh is looked for.
        status, body = rest(lab, "/monarch/meshes/nope/attach", "POST",
                            json.dumps({"kernel_id": "4f6c2d1e-8a3b-4c5d-9e7f-0a1b2c3d4e5f"}).encode())
        assert (status, body.get("message")) == (404, "no detached mesh named 'nope'"), (status, body)

        # Names come from the path (up to Jupyter Server's header limit): quoted cut short.
        long_name = "n" * 6000
        for method, path, data in (("GET", f"/monarch/meshes/{long_name}", None),
                                   ("DELETE", f"/monarch/meshes/{long_name}", None),
                                   ("POST", f"/monarch/meshes/{long_name}/attach",
                                    json.dumps({"kernel_id": "4f6c2d1e-8a3b-4c5d-9e7f-0a1b2c3d4e5f"}).encode())):
            status, body = rest(lab, path, method, data)
            assert status == 404 and len(body["message"]) < 300, (method, status, str(body)[:300])
            assert body["message"].startswith("no detached mesh named 'nnnn") and "(6000 characters)" in body["message"]
    finally:
        lab.stop()
