"""The rendezvous of an activation's process groups, kept by the process that activates the
mesh: ``RendezvousServer`` holds the keys (``KeyTable``) behind a port of this process, and
``KeeperClient`` is the ranks' way to it.  Requests and answers are the runtime's own
signed messages (a unix datagram on this host, Curve-encrypted ZeroMQ from another), so it
opens no listener and nothing outside the job reaches it.  Closing the server (when the
proc mesh stops) drops every key.

Example::

    server, rendezvous = serve_rendezvous(procs.ref.hosts)   # then, on each rank:
    Collectives(dims, ranks, me, rendezvous)
"""

from __future__ import annotations

import logging
import secrets
import socket
from collections.abc import Callable
from typing import Any

from ..actor.port import Channel, Port, PortReceiver
from ..runtime import ActorError, Part, Runtime, config
from .controller.keys import KeyTable
from .rendezvous import OPERATIONS, Rendezvous

log = logging.getLogger(__name__)
# A wait's answer may come this much after its own timeout (the trip, a busy controller)
# before the rank stops listening for it.
ANSWER_GRACE_S = config.seconds("rendezvous_answer_grace")


class RendezvousServer:
    """The keys of one activation, served on a port of this process.  Requests are handled
    on the IO thread, none of them blocking: a wait for a key not set yet is answered when
    a rank sets it, or fails after its timeout."""

    def __init__(self) -> None:
        self.table = KeyTable()
        self._rt = Runtime.current()
        t = self.table
        self._ops: dict[str, Callable[..., Any]] = {
            "set": t.set, "multi_set": t.multi_set, "add": t.add, "compare_set": t.compare_set, "append": t.append,
            "delete_key": t.delete_key, "num_keys": t.num_keys, "check": t.check}
        self._port_id = self._rt.open_port(self._on_request, once=False)
        self.port: Port = Port(self._rt.port_address, self._port_id)

    def _on_request(self, part: Part) -> None:
        try:
            reply, op, args, timeout = part.load()
        except Exception as e:  # noqa: BLE001  (no reply port to answer: say so here)
            log.error("monarch_kernel: a rendezvous request was dropped: %r", e)
            return
        try:
            if op == "wait":
                self._wait(reply, args, timeout)
            elif op in self._ops:
                reply.send(self._ops[op](*args))
            else:
                raise ValueError(f"the rendezvous has no operation {op!r}; it has {', '.join(OPERATIONS)}")
        except Exception as e:  # noqa: BLE001  (the rank that asked hears of it)
            reply.exception(e)

    def _wait(self, reply: Port, args, timeout: float | None) -> None:
        keys, values = args

        def answer(got, error: BaseException | None) -> None:
            if error is None:
                reply.send(got)
            else:
                reply.exception(error)

        waiter = self.table.wait(list(keys), bool(values), answer, timeout)
        if waiter is not None and timeout is not None:
            io = self._rt.io
            io.call_soon(io.loop.call_later, timeout, self.table.expire, waiter)

    def close(self) -> None:
        """Stop serving: the keys go, pending waits fail, later requests are dropped."""
        self._rt.close_port(self._port_id)
        self.table.close()


class KeeperClient:
    """A ``Keeper`` (tensors/rendezvous.py) over the server's port; picklable, so it travels
    to the ranks inside their ``Rendezvous``."""

    def __init__(self, port: Port):
        self.port = port

    def ask(self, op: str, args: tuple, timeout: float | None) -> Any:
        if op not in OPERATIONS:
            raise ValueError(f"the rendezvous has no operation {op!r}; it has {', '.join(OPERATIONS)}")
        pair: tuple[Port[Any], PortReceiver[Any]] = Channel.open(once=True)
        reply, answers = pair
        self.port.send((reply, op, args, timeout))
        limit = None if timeout is None else timeout + ANSWER_GRACE_S
        try:
            return answers.recv().get(timeout=limit)
        except ActorError as e:
            if isinstance(e.__cause__, TimeoutError):
                raise TimeoutError(str(e.__cause__)) from None
            raise
        except TimeoutError:
            Runtime.current().close_port(reply.port_id)  # a late answer finds no port
            raise TimeoutError(f"the rendezvous (in the controller) did not answer {op} within {limit:g} s") from None


def serve_rendezvous(hosts) -> tuple[RendezvousServer, Rendezvous]:
    """A rendezvous served by this process, and the ``Rendezvous`` that leads the ranks on
    ``hosts`` (a proc mesh's host names) to it, with a fresh key prefix."""
    server = RendezvousServer()
    return server, Rendezvous(secrets.token_hex(8), _one_host(hosts), KeeperClient(server.port))


def _one_host(hosts) -> bool:
    """Whether every rank runs on one host (then the ranks' gloo binds the loopback)."""
    here = {socket.gethostname(), "localhost", "127.0.0.1", "", None}
    return len(set(hosts)) <= 1 or all(h in here for h in hosts)
