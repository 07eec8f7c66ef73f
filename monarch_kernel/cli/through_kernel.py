"""A ``%mesh`` line run in the running kernel that holds a mesh or job (its connection file,
named in its record), for what only that kernel can do (stopping its mesh, killing its job).
A kernel busy with a cell answers once the cell ends; past the timeout, the command fails
saying so.
"""

from __future__ import annotations

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
    out: list[str] = []
    errors: list[str] = []

    def hook(msg) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            errors.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")

    try:
        try:
            kc.wait_for_ready(timeout=timeout)  # its channels are up (no early output is missed)
            kc.execute_interactive(line, store_history=False, timeout=timeout, output_hook=hook)
        except (TimeoutError, RuntimeError):
            raise Failed(f"kernel pid {kernel.get('pid')} did not run  {line}  within {timeout:g} s (busy with "
                         "a cell? interrupt it, or wait and try again)", as_json) from None
        if errors:
            raise Failed(f"{line} in kernel pid {kernel.get('pid')}: {errors[0]}", as_json)
        return "".join(out).rstrip("\n")
    finally:
        kc.stop_channels()
