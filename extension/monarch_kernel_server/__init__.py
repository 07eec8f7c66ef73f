"""monarch-kernel's Jupyter Server extension: the REST API of detached meshes, which the
Mesh panel shows even when no kernel has them attached.

    GET    /monarch/meshes                  every detached mesh: name, ranks, hosts, pids,
                                            start time, the kernel attached (if any)
    GET    /monarch/meshes/{name}           that one (404 if there is none)
    DELETE /monarch/meshes/{name}           stop it (its ranks and host end)
    POST   /monarch/meshes/{name}/attach    {"kernel_id": ID}: that kernel attaches it

Jupyter Server's own authentication guards every request (token or cookie, and XSRF for
cookies); errors are JSON with a ``message``.  docs/reference/rest.md's table lists every route's
bodies and status codes.  The server process never becomes a mesh
controller: what needs the mesh's connection runs in a short-lived helper process
(``monarch_kernel.detached.listing``) or in the kernel itself.
"""

from __future__ import annotations

from .handlers import setup_handlers

__all__ = ["setup_handlers"]


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "monarch_kernel_server"}]


def _load_jupyter_server_extension(serverapp) -> None:
    setup_handlers(serverapp.web_app)
    serverapp.log.info("monarch_kernel_server: /monarch/meshes is served")
