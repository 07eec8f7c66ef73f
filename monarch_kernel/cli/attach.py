"""``monarch-kernel attach NAME``: a terminal console on a mesh.  A detached mesh gets a new
monarch kernel that attaches it (``%mesh attach NAME``), then ``jupyter console`` on that
kernel; the kernel ends with the console (the mesh runs on).  A running kernel's mesh gets
``jupyter console`` on that kernel itself (which runs on after the console).
"""

from __future__ import annotations

import subprocess
import sys

import click

from ..kernel.kernelspec import KERNEL_NAME
from .output import Failed
from .targets import Target


def console(connection_file: str, console_args: tuple[str, ...]) -> int:
    """``jupyter console --existing`` on this terminal, until the user leaves it."""
    import importlib.util

    if importlib.util.find_spec("jupyter_console") is None:
        raise Failed("monarch-kernel attach runs jupyter console, which is not installed: pip install jupyter-console")
    argv = [sys.executable, "-m", "jupyter_console", "--existing", connection_file, *console_args]
    return subprocess.call(argv)


def attach(target: Target, console_args: tuple[str, ...]) -> int:
    if target.kind == "mesh":
        where = target.kernel.get("connection_file") or ""
        if not where:
            raise Failed(f"mesh {target.name!r} is {target.owner}'s, which names no connection file")
        click.echo(f"mesh {target.name} is {target.owner}'s: a console on that kernel "
                   f"(%mesh use {target.name} makes it current; leave with Ctrl-D, the kernel runs on)", err=True)
        return console(where, console_args)
    if target.kind != "detached" or target.row["state"] != "running":
        raise Failed(f"{target.name!r} is a {target.kind} ({target.row['state']}): only a running mesh has a "
                     "console; monarch-kernel ls says which run")
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import NoSuchKernel

    km = KernelManager(kernel_name=KERNEL_NAME)
    try:
        km.start_kernel()
    except NoSuchKernel:
        raise Failed(f"the {KERNEL_NAME!r} kernel is not installed: python -m monarch_kernel install --user") from None
    try:
        kc = km.blocking_client()
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=60)
            reply = kc.execute_interactive(f"%mesh attach {target.name}", timeout=120, store_history=False,
                                           output_hook=lambda m: _echo(m))
        finally:
            kc.stop_channels()
        if reply["content"]["status"] != "ok":
            raise Failed(f"the new kernel could not attach {target.name!r}: {reply['content'].get('evalue', '')}")
        click.echo(f"a new monarch kernel has mesh {target.name} attached; %%mesh cells run on it "
                   "(leave with Ctrl-D: the kernel ends, the mesh runs on)", err=True)
        return console(km.connection_file, console_args)
    finally:
        km.shutdown_kernel(now=False)


def _echo(msg) -> None:
    if msg["msg_type"] == "stream":
        click.echo(msg["content"]["text"], nl=False, err=True)
