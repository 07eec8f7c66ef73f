"""A ``%mesh`` line run in the running kernel that holds a mesh or job (its connection file,
named in its record), for what only that kernel can do (stopping its mesh, killing its job).
A kernel busy with a cell answers once the cell ends; past the timeout, the command fails
saying so.
"""

from __future__ import annotations

import queue
import time

from .output import Failed


def run_magic(kernel: dict, line: str, timeout: float, as_json: bool) -> str:
    """``line`` (``%mesh stop NAME``) run in ``kernel`` (its live record); its printed text."""
    from jupyter_client import BlockingKernelClient

    where = kernel.get("connection_file") or ""
    if not where:
        raise Failed(f"kernel pid {kernel.get('pid')} names no connection file (not a Jupyter kernel): "
                     f"run  {line}  in it", as_json)
    kc = BlockingKernelClient(connection_file=where)
    try:
        kc.load_connection_file()
    except OSError as e:
        raise Failed(f"cannot read kernel pid {kernel.get('pid')}'s connection file {where}: {e}", as_json) from None
    kc.start_channels()
    try:
        msg_id = kc.execute(line, store_history=False)
        deadline = time.monotonic() + timeout
        out: list[str] = []
        while True:
            try:
                msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise Failed(f"kernel pid {kernel.get('pid')} did not run  {line}  within {timeout:g} s (busy with "
                             "a cell? interrupt it, or wait and try again)", as_json) from None
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                raise Failed(f"{line} in kernel pid {kernel.get('pid')}: {content['ename']}: {content['evalue']}",
                             as_json)
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(out).rstrip("\n")
    finally:
        kc.stop_channels()
