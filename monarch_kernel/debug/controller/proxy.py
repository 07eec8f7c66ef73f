"""JupyterLab's debugger on any rank: ``MeshDebugger`` is ipykernel's debugger (the kernel's
``debugger_class``) that, after ``%mesh debug R``, hands the frontend's DAP session to rank
R's debugpy (``RankTarget``), and the functions the ``%mesh`` magics call.

Runs in the kernel.  Requests arrive on the control channel as ``debug_request``; with a
rank chosen they go to that rank's debugpy through the rank's relay (``tunnel.py``: actor
messages on the job's own connection, never a socket to the rank's debug port) and its
events come back as ``debug_event``.  Switching ranks repeats the frontend's handshake (initialize, attach,
breakpoints) on the new target, and is refused while the current one is stopped, so it
never leaves a rank suspended.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import zmq
from ipykernel.compiler import get_file_name, get_tmp_directory
from ipykernel.debugger import Debugger
from IPython.core.error import UsageError

from ...actor.errors import ActorError
from ...runtime import hosts, private_files
from ..messages import RankHost
from ..rank import rank_debugpy
from ..rank.inspector import Inspector
from ..rank.relay import DapRelay
from . import kernel_debugpy
from .listen_gate import SECRET_FIELD, ListenGate
from .rank_target import INSPECT_TIMEOUT_S, REPLY_TIMEOUT_S, FrontendState, RankTarget


@dataclass
class RankHelpers:
    """The actors the kernel keeps on a debugged rank, and what it learnt of the rank."""

    inspector: Any  # Inspector: the variable panel while the rank runs
    relay: Any  # DapRelay: the DAP session's way to the rank's debugpy
    ident: str = ""  # the rank's debugpy (a new one means the rank was restarted)
    host: RankHost | None = None


_helpers: dict[tuple[str, int], RankHelpers] = {}  # (mesh id, rank) -> its helpers
_gates: dict[tuple[str, int], ListenGate] = {}  # (mesh id, rank) -> its latest --listen port


class MeshDebugger(Debugger):
    """ipykernel's debugger for the kernel itself, or a relay to the rank chosen by
    ``%mesh debug R`` (``target``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        import debugpy

        # Rank processes start from the kernel: debugpy must not hook into their launch
        # (they would wait for a debugger); ranks get their own debugpy on demand.
        debugpy.configure(subProcess=False)
        self.target: RankTarget | None = None
        self.frontend = FrontendState()
        # One worker keeps the frontend's requests in order while they block on a rank.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mesh-debug")
        self.control_loop: asyncio.AbstractEventLoop | None = None
        self.refused_why = ""  # why start() refused, for the frontend

    async def process_request(self, message):
        self.control_loop = asyncio.get_running_loop()
        target = self.target
        if target is None:
            reply = await super().process_request(message)
            if message.get("command") == "initialize" and reply and not reply.get("success") and self.refused_why:
                reply["message"] = self.refused_why
        else:
            reply = await self.control_loop.run_in_executor(self._executor, target.handle, message, self.frontend)
        self.frontend.record(message)
        return reply

    def start(self):
        """ipykernel's ``start``, the kernel's debugpy started by ``kernel_debugpy`` (its ports
        this user's only) where ipykernel would call ``debugpy.listen``: on the shell thread,
        through an execute request."""
        self.refused_why = ""
        try:
            private_files.private_dir(get_tmp_directory())  # where dumpCell writes cells
        except OSError as e:  # NotPrivate included: never write cells where others may read them
            self.refused_why = f"the debugger cannot start: {e}"
            self.log.error("%s", self.refused_why)
            return False
        if not self.debugpy_initialized:
            host, port = self.debugpy_client.get_host_port()
            content = {"code": kernel_debugpy.LISTEN_CODE.format(host, int(port)), "silent": True}
            self.session.send(self.shell_socket, "execute_request", content, None,
                              self.shell_socket.getsockopt(zmq.ROUTING_ID))
            _ident, msg = self.session.recv(self.shell_socket, mode=0)
            if msg["content"]["status"] != "ok":
                self.log.error("The kernel's debugpy did not start: %s", msg["content"].get("evalue", ""))
                return False
            self.debugpy_initialized = True
        return super().start()  # debugpy_initialized: it connects ipykernel's client, and never listens

    async def dumpCell(self, message):
        """ipykernel's ``dumpCell`` (the kernel debugged), writing the cell as ranks do: 0600,
        never through a link, in the cell folder checked to be this user's."""
        code = message["arguments"]["code"]
        path = get_file_name(code)
        reply = {"type": "response", "request_seq": message["seq"], "command": message["command"]}
        try:
            rank_debugpy.write_source(path, code)
        except OSError as e:  # NotPrivate included
            return {**reply, "success": False, "message": str(e)}
        return {**reply, "success": True, "body": {"sourcePath": path}}

    def _stopped_where(self) -> str:
        if self.target is not None and self.target.stopped_threads:
            return self.target.label
        if self.target is None and self.stopped_threads:
            return "the kernel"
        return ""

    def switch(self, target: RankTarget | None) -> None:
        """Point the frontend's session at ``target`` (None: the kernel itself).

        Called from the shell thread (``%mesh debug``); blocks until the new target has
        the frontend's breakpoints.
        """
        where = self._stopped_where()
        if where:
            raise UsageError(f"{where} is stopped in the debugger: continue it (or turn the debugger off) "
                             f"before switching with %mesh debug")
        old, started = self.target, self.frontend.attached
        if old is not None:
            old.current = False
            old.disconnect()
        elif started and self.is_started:
            self._in_control_loop(self._kernel_request("disconnect", {"restart": False, "terminateDebuggee": False}))
        self.target = target
        if not started:
            return
        if target is None and not self.debugpy_initialized:
            self._listen_here()
        if target is not None:
            target.connect(self.frontend.initialize)
            target.attach(self.frontend.attach, self.frontend)
        else:
            self._in_control_loop(self._restart_kernel_session())

    def _listen_here(self) -> None:
        """Start the kernel's own debugpy on this (the shell's) thread, as ``start()`` would
        through an execute request, which cannot run while this cell does."""
        private_files.private_dir(get_tmp_directory())  # where dumpCell writes cells
        host, port = self.debugpy_client.get_host_port()
        kernel_debugpy.listen(host, int(port))
        self.debugpy_initialized = True

    async def _kernel_request(self, command: str, arguments: dict | None = None) -> dict:
        msg = {"type": "request", "seq": 0, "command": command}
        if arguments is not None:
            msg["arguments"] = arguments
        return await super().process_request(msg)

    async def _restart_kernel_session(self) -> None:
        """Give the kernel's own debugpy the frontend's session back."""
        state = self.frontend
        await self._kernel_request("initialize", state.initialize or {})
        await self._kernel_request("attach", dict(state.attach or {}))
        for args in state.breakpoints.values():
            await self._kernel_request("setBreakpoints", args)
        if state.exceptions is not None:
            await self._kernel_request("setExceptionBreakpoints", state.exceptions)

    def _in_control_loop(self, coro) -> None:
        loop = self.control_loop
        if loop is None:  # the frontend never sent a request: nothing runs there yet
            coro.close()
            return
        asyncio.run_coroutine_threadsafe(coro, loop).result(REPLY_TIMEOUT_S)


def command(session, shell, args: list[str]) -> None:
    """``%mesh debug R [--listen [--host H]]`` and ``%mesh debug off``."""
    usage = ("type  %mesh debug R  (JupyterLab's debugger on rank R),  %mesh debug R --listen [--host H]  "
             "(an attach config for VS Code or any DAP client), or  %mesh debug off")
    if args == ["off"]:
        dbg = _kernel_debugger(shell)
        dbg.switch(None)
        print("JupyterLab's debugger now debugs the kernel itself")
        return
    if not args:
        target = getattr(getattr(getattr(shell, "kernel", None), "debugger", None), "target", None)
        print(f"JupyterLab's debugger is on {target.label}" if target is not None
              else "JupyterLab's debugger is on the kernel itself;  %mesh debug R  moves it to rank R")
        return
    rank_word, flags = args[0], args[1:]
    listen, host = False, None
    it = iter(flags)
    for a in it:
        if a == "--listen":
            listen = True
        elif a == "--host":
            host = next(it, None)
            if not host:
                raise UsageError("--host needs a loopback address, e.g.  %mesh debug 3 --listen --host ::1")
        else:
            raise UsageError(f"%mesh debug: unexpected {a!r}; {usage}")
    if host is not None and not listen:
        raise UsageError("--host goes with --listen:  %mesh debug 3 --listen --host ::1")
    if host is not None and rank_debugpy.loopback(host) is None:
        raise UsageError(f"%mesh debug: --host {host} is not a loopback address.  The debugger listens only on the "
                         f"loopback (127.0.0.1 or ::1), where it can check that a client is you; to attach from "
                         f"another machine, forward a port to it:  ssh -N -L PORT:127.0.0.1:PORT "
                         f"{socket.gethostname()}")
    try:
        rank = int(rank_word)
    except ValueError:
        raise UsageError(usage) from None
    procs, consoles = session.get()
    if not 0 <= rank < len(procs):
        raise UsageError(f"%mesh debug {rank}: the mesh has ranks 0-{len(procs) - 1}")
    one = consoles.flatten("ranks").slice(ranks=rank)  # counted across every dim (hosts too)
    key = (procs.ref.id, rank)
    helpers = _helpers.get(key)
    fresh = None
    if helpers is None:
        # Spawned before debugpy starts on the rank: an actor thread started after it
        # makes an interrupt of a rank stopped at a breakpoint land a line late.
        fresh = _spawn_helpers(procs, rank)
    ident = one.debug_start.call_one().get(timeout=REPLY_TIMEOUT_S)
    if helpers is not None and helpers.ident != ident:  # the rank was restarted: its helpers went with it
        fresh = _spawn_helpers(procs, rank)
    if fresh is not None:
        fresh.ident = ident
        fresh.host = RankHost.decode(fresh.relay.where.call_one().get(timeout=REPLY_TIMEOUT_S))
        helpers = _helpers[key] = fresh
    assert helpers is not None and helpers.host is not None
    mesh_host = procs.ref.hosts[rank] if rank < len(procs.ref.hosts) else ""
    remote = is_remote(helpers.host, mesh_host)
    if listen:
        old_gate = _gates.pop(key, None)
        if old_gate is not None:
            old_gate.close()  # a port given before and not used yet closes
        address = rank_debugpy.loopback(host or "127.0.0.1") or "127.0.0.1"
        gate = _gates[key] = ListenGate(helpers.relay, f"{procs.name} rank {rank}", address)
        on = f" (on {ssh_host(helpers.host, mesh_host)}; " if remote else " ("
        print(f"rank {rank}{on}the kernel relays the session over the mesh's own connection) takes one DAP "
              f"client at {gate.host}:{gate.port} on this machine.  From another machine, forward a port to it "
              f"first:  {ssh_forward(gate.port, gate.host, gate.port, socket.gethostname())}")
        print(launch_config(procs.name, rank, gate.host, gate.port, gate.secret))
        return
    dbg = _kernel_debugger(shell)
    current = dbg.target
    if current is not None and (current.mesh, current.rank) == (procs.name, rank) and current.conn is not None:
        print(f"JupyterLab's debugger is already on {current.label}")
        return
    dbg.switch(RankTarget(helpers.inspector, procs.name, rank, dbg.event_callback, relay=helpers.relay,
                          remote=remote))
    on = f" on {ssh_host(helpers.host, mesh_host)}" if remote else ""
    print(f"JupyterLab's debugger now debugs rank {rank}{on} (the kernel reaches its debugpy through the rank's "
          f"relay, over the mesh's own connection): set breakpoints in %%mesh cells and run them.  "
          f"%mesh debug off goes back to the kernel.")


def _spawn_helpers(procs, rank: int) -> RankHelpers:
    one = procs.flatten("ranks").slice(ranks=rank)
    tag = uuid.uuid4().hex[:8]
    return RankHelpers(one.spawn(f"inspector-{tag}", Inspector), one.spawn(f"dap-relay-{tag}", DapRelay))


def is_remote(rank_host: RankHost, mesh_host: str = "") -> bool:
    """Whether a rank runs on another host than the kernel: another machine (its name, or
    the mesh's record of it, differs) or another network namespace (its loopback is not ours)."""
    here = socket.gethostname()
    return (rank_host.host_key != hosts.host_key() or rank_host.hostname != here
            or bool(mesh_host) and mesh_host != here)


def ssh_host(rank_host: RankHost, mesh_host: str = "") -> str:
    """What to ``ssh`` to for a rank's host: the mesh's name for it, else the rank's own
    name, unless that is this machine's too (a container or network namespace here): then
    its first address that is not loopback."""
    here = socket.gethostname()
    if mesh_host and mesh_host != here:
        return mesh_host
    if rank_host.hostname != here:
        return rank_host.hostname
    return next((a for a in rank_host.addresses if not a.startswith("127.")), rank_host.hostname)


def ssh_forward(local_port: int, host: str, port: int, ssh_to: str) -> str:
    """The ssh command that makes ``host:port`` on ``ssh_to`` (a loopback address there)
    reachable at 127.0.0.1:``local_port`` where it runs."""
    far = f"[{host}]" if ":" in host else host  # an IPv6 address, as ssh -L wants it
    return f"ssh -N -L {local_port}:{far}:{port} {ssh_to}"


def forget_mesh(shell, mesh: str) -> None:
    """Before a mesh stops: its unused ``--listen`` ports close, and if the debugger is on one
    of its ranks, it goes back to the kernel."""
    for key, gate in list(_gates.items()):
        if gate.label.startswith(f"{mesh} "):
            _gates.pop(key, None)
            gate.close()
    dbg = getattr(getattr(shell, "kernel", None), "debugger", None)
    target = getattr(dbg, "target", None)
    if isinstance(target, RankTarget) and target.mesh == mesh and dbg is not None:
        target.stopped_threads.clear()  # the rank is about to end; nothing to resume
        dbg.switch(None)
        print(f"JupyterLab's debugger was on {target.label}; it now debugs the kernel itself")


def stopped_rank(shell, mesh: str, ranks) -> int | None:
    """The rank among ``ranks`` that JupyterLab's debugger holds stopped, if any."""
    dbg = getattr(getattr(shell, "kernel", None), "debugger", None)
    target = getattr(dbg, "target", None)
    if isinstance(target, RankTarget) and target.mesh == mesh and target.rank in ranks and target.stopped_threads:
        return target.rank
    return None


def release_for_interrupt(shell, mesh: str, ranks, console_id: str = "") -> None:
    """Resume a rank stopped in JupyterLab's debugger so the interrupt sent to it lands:
    a thread suspended by debugpy takes a pending KeyboardInterrupt only once it runs.
    ``console_id``: interrupt that actor first, through the rank's inspector."""
    dbg = getattr(getattr(shell, "kernel", None), "debugger", None)
    target = getattr(dbg, "target", None)
    if not isinstance(target, RankTarget) or target.mesh != mesh or target.rank not in ranks:
        return
    if console_id and target.stopped_threads:
        try:
            target.inspector.interrupt.call_one(console_id).get(timeout=INSPECT_TIMEOUT_S)
        except (TimeoutError, ActorError):
            pass  # the rank is gone or stuck: resuming it below is all that is left
    for thread in list(target.stopped_threads):
        try:
            target.request("continue", {"threadId": thread})
        except (ConnectionError, concurrent.futures.TimeoutError):
            pass


def launch_config(mesh: str, rank: int, host: str, port: int, secret: str) -> str:
    """A VS Code ``launch.json`` "attach" entry for a ``--listen`` port: VS Code passes its
    ``SECRET_FIELD`` in the attach request, which is how the port knows the client is yours."""
    entry = {"name": f"monarch {mesh} rank {rank}", "type": "debugpy", "request": "attach",
             "connect": {"host": host, "port": port}, "justMyCode": False, SECRET_FIELD: secret}
    return (f"Add this to .vscode/launch.json \"configurations\" (it holds this session's secret: keep it to "
            f"yourself).  The port takes one client, run by you and attaching with this entry's secret (any "
            f"other is closed before it reaches the rank), then closes; %mesh debug {rank} --listen again opens "
            f"another:\n" + json.dumps(entry, indent=2))


def _kernel_debugger(shell) -> MeshDebugger:
    dbg = getattr(getattr(shell, "kernel", None), "debugger", None)
    if not isinstance(dbg, MeshDebugger):
        raise UsageError("JupyterLab's debugger on a rank needs the 'Python 3 (monarch mesh)' kernel; "
                         "here, use  %mesh debug R --listen  and attach VS Code (or any DAP client)")
    return dbg
