"""A controller's session with one worker (``python -m monarch_kernel.agent --listen``):
the handshake, the hand-over of the job's credentials, and the connection kept open.

Each side proves it holds the key file's key (``worker_wire``); over CurveZMQ keys derived
from that session, the worker gets the job's credentials and starts an agent with them,
which connects back here as an ssh-started one does.  The session's connection stays open:
its end says the worker is gone (its ranks then fail with ``ProcessDied`` naming it, at
once), and this controller's end (or its ``Release``) tells the worker to end them.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import TypeVar

import zmq

from ..agent import worker_key
from ..agent import worker_wire as wire
from ..runtime.hosting import AgentLink, Runtime, config, hosts

M = TypeVar("M", bound=wire.Message)
RETRY_S = config.seconds("worker_retry")
END_S = config.seconds("worker_agent_end") + wire.HANDSHAKE_S  # the worker ends its agent within this


def parse_worker(worker) -> tuple[str, int]:
    """(host, port) of a worker's address, ``tcp://HOST:PORT``; a ValueError saying what to type."""
    example = 'workers=["tcp://node1:29500", "tcp://node2:29500"]'
    if not isinstance(worker, str) or not worker.startswith("tcp://"):
        raise ValueError(f"a worker is its --listen address as the controller reaches it, {example}; "
                         f"not {worker!r}")
    host, sep, port = worker[len("tcp://"):].rpartition(":")
    if not sep or not host or host in ("*", "0.0.0.0") or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker {worker!r:.80}: give the host's name or address and the port it listens on, "
                         f"{example}")
    return hosts.check_name(host.strip("[]"), "a worker's host", example), int(port)


class WorkerSession:
    """This controller's hold on one worker: the handshake's connection, kept open, and the
    link to the agent the worker started."""

    def __init__(self, rt: Runtime, worker: str, key: bytes):
        self.rt = rt
        self.worker = worker
        self.host, self.port = parse_worker(worker)
        self._key = key
        self.link: AgentLink | None = None  # once the worker took the credentials
        self.sock: socket.socket | None = None
        self.codec: wire.Codec | None = None
        self.ended = threading.Event()  # the session is over (the worker said so, or its connection closed)
        self.why = ""

    def open(self, controller: str, deadline: float) -> None:
        """Handshake, take the worker, and hand it the credentials; returns once its agent
        started (``wait_up`` waits for it to connect)."""
        while True:
            sock = self._connect(deadline)
            try:
                session = wire.client_handshake(sock, self._key, deadline)
                codec = wire.Codec(session, worker=False)
                hello = wire.recv_message(sock, codec, deadline)
                if not isinstance(hello, wire.Hello):
                    raise wire.HandshakeFailed(f"it began with {hello.OP}, not hello")
            except wire.WorkerBusy:
                hello = None
            except wire.HandshakeFailed as e:
                sock.close()
                raise PermissionError(f"cannot attach to the worker {self.worker}: {e}.  Both sides must use the "
                                      "same key file (python -m monarch_kernel key new PATH, copied to the "
                                      "hosts)") from None
            except TimeoutError as e:
                sock.close()
                raise TimeoutError(f"cannot attach to the worker {self.worker}: {e}") from None
            except OSError as e:
                sock.close()
                raise ConnectionError(f"cannot attach to the worker {self.worker}: {e}") from None
            except BaseException:
                sock.close()
                raise
            if hello is not None and hello.state == "free":
                break
            sock.close()  # busy with other connections, or ending the ranks of the controller before
            mine = f"(pid {os.getpid()} on {socket.gethostname()})"
            if hello is not None and hello.state == "busy" and mine in hello.holder:
                raise ConnectionError(f"the worker {self.worker} (pid {hello.pid} on {hello.hostname}) is attached to "
                                      f"this controller already, by another job of it: {hello.holder}.  Use that "
                                      "job's hosts, or stop them (hosts.stop()) first")
            if hello is not None and hello.state == "busy":
                raise ConnectionError(f"the worker {self.worker} (pid {hello.pid} on {hello.hostname}) serves "
                                      f"another controller: {hello.holder}.  Stop that one's hosts there "
                                      "(hosts.stop()) or end it, then attach again")
            if time.monotonic() + RETRY_S > deadline:
                raise TimeoutError(f"the worker {self.worker} was not free in time (it was ending the ranks of "
                                   f"the controller before, or too many connections were proving the key)")
            time.sleep(RETRY_S)
        self.sock, self.codec = sock, codec
        try:
            self._take(sock, codec, session, controller, deadline)
        except BaseException:
            self.close()
            raise
        threading.Thread(target=self._watch, name=f"monarch-worker-{self.worker}",
                         daemon=True).start()

    def _connect(self, deadline: float) -> socket.socket:
        try:
            sock = socket.create_connection((self.host, self.port), timeout=max(0.1, deadline - time.monotonic()))
        except OSError as e:
            raise ConnectionError(f"cannot reach the worker {self.worker}: {e.strerror or e}; is "
                                  f"`python -m monarch_kernel.agent --listen ...` running there, and is the "
                                  "port open to this machine?") from None
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
            if hasattr(socket, opt):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
        return sock

    def _take(self, sock: socket.socket, codec: wire.Codec, session: bytes, controller: str,
              deadline: float) -> None:
        who = f"the controller {controller} (pid {os.getpid()} on {socket.gethostname()})"
        sock.sendall(codec.pack(wire.Attach(who)))
        channel = self._expect(sock, codec, wire.Channel, deadline)
        self.link = link = self.rt.add_host(self.host)
        line = link.credentials(controller)
        keys = worker_key.session_curve(session)
        ctx = zmq.Context()
        try:
            push = ctx.socket(zmq.PUSH)
            keys.connect_as_client(push)
            push.connect(f"tcp://{_bracket(sock.getpeername()[0])}:{channel.port}")
            push.send_multipart([line, worker_key.mac(session, b"credentials", line)])
            push.close(linger=int(max(0.0, deadline - time.monotonic()) * 1000))  # until it is sent
        finally:
            ctx.term()
        self._expect(sock, codec, wire.Started, deadline)

    def _expect(self, sock: socket.socket, codec: wire.Codec, kind: type[M], deadline: float) -> M:
        msg = wire.recv_message(sock, codec, deadline)
        if isinstance(msg, wire.Ended):
            raise ConnectionError(f"the worker {self.worker} could not take this controller: {msg.why}")
        if not isinstance(msg, kind):
            raise wire.MalformedMessage(f"the worker {self.worker} sent {msg.OP}, not {kind.OP}")
        return msg

    def _watch(self) -> None:
        """Until the session ends: then the worker's agent, and its ranks, are gone."""
        sock, codec = self.sock, self.codec
        assert sock is not None and codec is not None
        why = ""
        try:
            while not why:
                msg = wire.recv_message(sock, codec, None)
                if isinstance(msg, wire.Ended):
                    why = f"the worker {self.worker} ended its agent: {msg.why}"
        except (OSError, wire.HandshakeFailed, wire.MalformedMessage) as e:
            why = f"the worker {self.worker} is gone (its connection ended: {e})"
        self.why = why
        self.ended.set()
        link = self.link
        if link is not None:
            self.rt.io.call_soon(link.gone, why)

    def wait_up(self, deadline: float) -> None:
        """Until the worker's agent has connected back here."""
        assert self.link is not None
        while not self.link.up.wait(0.05):
            if self.ended.is_set() or time.monotonic() > deadline:
                break
        if self.link.up.done() and self.link.up.error() is None:
            return
        hint = (f"is this controller's address {self.rt.net_address} reachable from {self.host}?  "
                "Set MONARCH_KERNEL_BIND to one that is, before the first job")
        if self.ended.is_set():
            raise ConnectionError(f"the agent of the worker {self.worker} did not connect back ({hint}): {self.why}")
        raise TimeoutError(f"the agent of the worker {self.worker} did not connect back in time: {hint}")

    def end(self, shutdown: bool) -> None:
        """Let go of the worker (``shutdown``: and have it exit); returns once its agent ended."""
        sock = self.sock
        if sock is None:
            return
        if self.link is not None:
            self.rt.end_host(self.link, bye=False)  # its ranks' ends are no failure
        if not self.ended.is_set() and self.codec is not None:
            try:
                sock.sendall(self.codec.pack(wire.Shutdown() if shutdown else wire.Release()))
            except OSError:
                pass
            if self.link is None or self.link.alive:  # not a host already declared gone (silent)
                self.ended.wait(END_S)
        self.close()

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self.link is not None and not self.ended.is_set():
            self.rt.io.call_soon(self.link.gone, f"this controller let go of the worker {self.worker}")


def _bracket(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip
