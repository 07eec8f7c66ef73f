"""A worker: ``python -m monarch_kernel.agent --listen tcp://ADDR:PORT --key-file PATH``, or
``run_worker_loop_forever(address=..., key=...)``, started by any scheduler (a batch script,
a Kubernetes pod, torchrun), waits for a controller that holds the key.

It serves one controller at a time and outlives each: a controller that attaches (the
handshake of ``worker_wire``) gets an agent on this host, started as ssh starts one (the
job's credentials on its stdin, which then stays open), so everything a job's host does
works here too.  When that controller lets go (``Release``), goes away (its connection
closes) or falls silent (the agent's own heartbeat), the agent ends its ranks and the
worker waits for the next controller; ``Shutdown`` (``job.kill()``), SIGTERM or SIGINT end
the worker too.

Anyone who can reach the port can connect, so nobody unknown may hold the worker up: a
connection must begin its proof within ``worker_first_proof`` (a controller sends it one round
trip after the greeting) and finish it within one deadline, having sent at most 48 bytes that
are read; connections still proving it are capped in all and per peer, and a peer address with
none of the slots takes one from the address that holds the most (so a few addresses cannot
fill them all); a wrong proof is counted, logged and closed, and the worker keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import logging
import os
import secrets
import signal
import socket
import sys
import time

import zmq

from ..runtime.hosting import Gatekeeper, config, diagnostics, hosts, rejects
from . import worker_key
from . import worker_wire as wire

log = logging.getLogger(__name__)

# Connections still proving the key: at most this many in all, and from one peer address.  A
# controller opens one per worker; one turned away tries again.
MAX_UNAUTHENTICATED = 64
MAX_UNAUTHENTICATED_PER_PEER = 16
AGENT_END_S = config.seconds("worker_agent_end")
FIRST_PROOF_S = config.seconds("worker_first_proof")
MAX_CREDENTIALS = 1 << 16  # the credentials line (keys, addresses, module names): a few hundred bytes
# What torchrun told a worker it started of its own job: not the ranks' (spmd gives each mesh
# its own torch.distributed environment), so the agent and its ranks start without them.
LAUNCHER_VARIABLES = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"})


def parse_listen(address: str) -> tuple[str, int]:
    """``tcp://ADDR:PORT`` (ADDR a name, an IPv4 address, or ``*`` for every interface) as
    (IPv4 address, port); a ValueError that says what to type for anything else."""
    example = "tcp://0.0.0.0:29500 (every interface) or tcp://10.0.0.5:29500"
    if not isinstance(address, str) or not address.startswith("tcp://"):
        raise ValueError(f"--listen {address!r}: give a TCP address, e.g. {example}")
    host, sep, port = address[len("tcp://"):].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {address!r}: give the address and a port, e.g. {example}")
    if host == "*":
        host = "0.0.0.0"
    hosts.check_name(host, f"--listen tcp://HOST:{port}", example)
    try:
        ip = str(socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except socket.gaierror as e:
        raise ValueError(f"--listen {address!r}: cannot resolve {host!r} ({e.strerror}); e.g. {example}") from None
    return ip, int(port)


class Worker:
    def __init__(self, ip: str, port: int, key: bytes):
        self.ip, self.port, self.key = ip, port, key
        self.address = ""  # once listening: tcp://ip:port (the port chosen, if 0 was asked)
        self.holder = ""  # the controller attached now ("" when free)
        self.ending = False  # ending the agent of the controller before
        # peer address -> its connections still proving the key, oldest first
        self._pending: dict[str, collections.OrderedDict[asyncio.StreamWriter, None]] = {}
        self._stop: asyncio.Event | None = None
        self._why_stop = ""

    # ------------------------------------------------------------ listening

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop, f"it got {signal.Signals(sig).name}")
        # limit: what an unknown peer may make this process buffer (reading pauses past twice it).
        server = await asyncio.start_server(self._connection, self.ip, self.port, reuse_address=True,
                                            backlog=128, limit=4096)
        port = server.sockets[0].getsockname()[1]
        self.address = f"tcp://{self.ip}:{port}"
        log.info("monarch_kernel worker: listening on %s (pid %d); waiting for a controller", self.address,
                 os.getpid())
        async with server:
            await self._stop.wait()
            server.close()
            while self.holder or self.ending:  # the session ends its agent first
                await asyncio.sleep(0.05)
        log.info("monarch_kernel worker: exiting (%s)", self._why_stop)

    def stop(self, why: str) -> None:
        if self._stop is not None and not self._stop.is_set():
            self._why_stop = why
            self._stop.set()

    def _admit(self, peer: str, writer: asyncio.StreamWriter) -> bool:
        """Whether a connection from ``peer`` may prove the key now.  When every slot is held, a
        peer holding fewer than the busiest peer takes the oldest of that peer's (closed at once)."""
        mine = self._pending.get(peer) or collections.OrderedDict()
        if len(mine) >= MAX_UNAUTHENTICATED_PER_PEER:
            return False
        if sum(len(w) for w in self._pending.values()) >= MAX_UNAUTHENTICATED:
            busiest = max(self._pending, key=lambda p: len(self._pending[p]))
            if len(self._pending[busiest]) <= len(mine) + 1:
                return False
            oldest = next(iter(self._pending[busiest]))
            self._admitted(busiest, oldest)
            oldest.transport.abort()  # its handshake ends as a closed connection
            rejects.count("worker", "busy", f"a connection from {busiest} still proving the key made room for "
                                            f"one from {peer}", logging.DEBUG)
        self._pending.setdefault(peer, collections.OrderedDict())[writer] = None
        return True

    def _admitted(self, peer: str, writer: asyncio.StreamWriter) -> None:
        mine = self._pending.get(peer)
        if mine is not None:
            mine.pop(writer, None)
            if not mine:
                del self._pending[peer]

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str((writer.get_extra_info("peername") or ("?",))[0])
        try:
            if not self._admit(peer, writer):
                rejects.count("worker", "busy", f"too many connections still proving the key ({peer})",
                              logging.DEBUG)
                writer.write(wire.BUSY)
                return
            try:
                session = await asyncio.wait_for(self._handshake(reader, writer), wire.HANDSHAKE_S)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                why = "timeout" if isinstance(e, asyncio.TimeoutError) else "closed"
                rejects.count("worker", why, f"a connection from {peer} did not finish the handshake", logging.INFO)
                return
            finally:
                self._admitted(peer, writer)
            if session is None:
                rejects.count("worker", "forged", f"a connection from {peer} does not hold this worker's key")
                writer.write(wire.REFUSED)
                return
            await self._session(reader, writer, wire.Codec(session, worker=True), session, peer)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, wire.HandshakeFailed,
                wire.MalformedMessage) as e:
            log.info("monarch_kernel worker: a connection from %s ended: %s", peer, e)
        finally:
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes | None:
        """The session key, or None when the peer's proof is wrong (reads exactly 48 bytes;
        the first within ``FIRST_PROOF_S``)."""
        nw = secrets.token_bytes(wire.NONCE)
        writer.write(wire.MAGIC + nw)
        await writer.drain()
        first = await asyncio.wait_for(reader.readexactly(1), FIRST_PROOF_S)
        got = first + await reader.readexactly(wire.HELLO - 1)
        nc, proof = got[:wire.NONCE], got[wire.NONCE:]
        if not hmac.compare_digest(proof, worker_key.mac(self.key, b"controller", nw, nc)):
            return None
        writer.write(worker_key.mac(self.key, b"worker", nc, nw))
        return worker_key.session_key(self.key, nw, nc)

    # ------------------------------------------------------------ one controller

    async def _session(self, reader, writer, codec: wire.Codec, session: bytes, peer: str) -> None:
        me = (socket.gethostname(), os.getpid(), sys.executable)
        if self.holder or self.ending:
            state = "busy" if self.holder else "ending"
            writer.write(codec.pack(wire.Hello(state, self.holder, *me)))
            await writer.drain()
            return
        self.holder = f"{peer} (attaching)"
        try:
            writer.write(codec.pack(wire.Hello("free", "", *me)))
            attach = await asyncio.wait_for(_recv(reader, codec), wire.HANDSHAKE_S)
            if not isinstance(attach, wire.Attach):
                raise wire.MalformedMessage(f"expected an attach, got {attach.OP}")
            self.holder = f"{attach.who[:200]} since {time.strftime('%H:%M:%S')}"
            local_ip = writer.get_extra_info("sockname")[0]
            line = await asyncio.wait_for(self._credentials(codec, writer, session, local_ip), wire.HANDSHAKE_S)
            await self._run_agent(reader, writer, codec, line, attach.who[:200])
        finally:
            self.holder = ""

    async def _credentials(self, codec: wire.Codec, writer, session: bytes, ip: str) -> bytes:
        """The job's credentials, received over CurveZMQ with the session's keys (secret, so
        never on the plain connection); signed with the session key as well."""
        loop = asyncio.get_running_loop()
        keys = worker_key.session_curve(session)
        ctx = zmq.Context()
        gate = Gatekeeper(ctx, loop, keys, lambda addr: rejects.count(
            "worker", "curve", f"a credentials connection from {addr} without the session's key"))
        sock = ctx.socket(zmq.PULL)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_CREDENTIALS)
            keys.serve(sock)
            sock.bind(f"tcp://{ip}:0")
            port = int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
            writer.write(codec.pack(wire.Channel(port)))
            await writer.drain()
            frames = await _recv_zmq(loop, sock)
        finally:
            sock.close(linger=0)
            gate.close()
            ctx.term()
        if len(frames) != 2 or not hmac.compare_digest(frames[1], worker_key.mac(session, b"credentials", frames[0])):
            raise wire.HandshakeFailed("credentials not signed with the session's key")
        line = frames[0]
        if not line.endswith(b"\n") or b"\n" in line[:-1]:
            raise wire.MalformedMessage("the credentials are not one line")
        return line

    async def _run_agent(self, reader, writer, codec: wire.Codec, line: bytes, who: str) -> None:
        # A session of its own: a ^C in the worker's terminal is not for the ranks.  It ends
        # when its stdin closes: when this worker closes it, or dies.
        agent = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "monarch_kernel.agent", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True,
            env=_agent_env())
        assert agent.stdin is not None and agent.stderr is not None and self._stop is not None
        tail: collections.deque[str] = collections.deque(maxlen=20)
        relay = asyncio.ensure_future(_relay(agent.stderr, tail))
        waits = [asyncio.ensure_future(_recv(reader, codec)), asyncio.ensure_future(agent.wait()),
                 asyncio.ensure_future(self._stop.wait())]
        asked, exited, stopped = waits
        try:
            agent.stdin.write(line)
            writer.write(codec.pack(wire.Started(agent.pid)))
            log.info("monarch_kernel worker: attached by %s (agent pid %d)", who, agent.pid)
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if exited in done:
                why = f"its agent exited with status {agent.returncode}" + (f": {tail[-1]}" if tail else "")
            elif stopped in done:
                why = f"the worker was stopped ({self._why_stop})"
            else:
                why = self._asked(asked)
            self.ending, self.holder = True, ""  # a controller that asks now waits for the end, then attaches
            await _end(agent)
            try:
                writer.write(codec.pack(wire.Ended(why)))
                await writer.drain()
            except OSError:
                pass
            log.info("monarch_kernel worker: detached from %s: %s; %s", who, why,
                     "exiting" if self._stop.is_set() else "waiting for the next controller")
        finally:
            self.ending, self.holder = True, ""
            for t in waits:
                t.cancel()
            await _end(agent)
            try:
                await asyncio.wait_for(relay, 2)
            except asyncio.TimeoutError:
                relay.cancel()
            self.ending = False

    def _asked(self, asked: asyncio.Future) -> str:
        """What the controller's message (or its connection's end) means for the session."""
        try:
            msg = asked.result()
        except (OSError, asyncio.IncompleteReadError, wire.HandshakeFailed, wire.MalformedMessage):
            return "the controller's connection closed (it exited, or its host is gone)"
        if isinstance(msg, wire.Shutdown):
            self.stop("the controller shut it down")
            return "the controller shut it down"
        if isinstance(msg, wire.Release):
            return "the controller let go of it"
        return f"the controller sent an unexpected {msg.OP}"


def _agent_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in LAUNCHER_VARIABLES and not k.startswith(("TORCHELASTIC_", "TORCH_ELASTIC_"))}


async def _recv(reader: asyncio.StreamReader, codec: wire.Codec) -> wire.Message:
    n = codec.length(await reader.readexactly(wire.LENGTH.size))
    sig = await reader.readexactly(wire.MAC)
    return codec.unpack(sig, await reader.readexactly(n) if n else b"")


async def _recv_zmq(loop: asyncio.AbstractEventLoop, sock: zmq.Socket) -> list[bytes]:
    """One message of ``sock`` (its descriptor is edge-triggered: check after each wake)."""
    got = loop.create_future()

    def readable() -> None:
        if not got.done() and int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            got.set_result(None)

    fd = int(sock.getsockopt(zmq.FD))
    loop.add_reader(fd, readable)
    try:
        readable()
        await got
    finally:
        loop.remove_reader(fd)
    return sock.recv_multipart(zmq.NOBLOCK)


async def _relay(stream: asyncio.StreamReader, tail: collections.deque) -> None:
    """The agent's stderr, to this worker's (its log), keeping the last lines for the controller."""
    while line := await stream.readline():
        text = line.decode(errors="replace").rstrip()
        tail.append(text)
        print(f"[agent] {text}", file=sys.stderr, flush=True)


async def _end(agent: asyncio.subprocess.Process) -> None:
    """Close the agent's stdin (it ends its ranks and exits, as when ssh goes); kill it if it
    has not within ``AGENT_END_S``."""
    if agent.returncode is None and agent.stdin is not None and not agent.stdin.is_closing():
        agent.stdin.close()
    try:
        await asyncio.wait_for(agent.wait(), AGENT_END_S)
    except asyncio.TimeoutError:
        log.warning("monarch_kernel worker: its agent (pid %d) did not end within %g s; killing it", agent.pid,
                    AGENT_END_S)
        agent.kill()
        await agent.wait()


def run_worker_loop_forever(*, address: str, key=None, ca=None, private_key=None) -> None:
    """Serve controllers that hold the key in file ``key`` at ``address`` (``tcp://ADDR:PORT``)
    until SIGTERM, SIGINT or a controller's ``job.kill()`` (Monarch's name; a key file stands
    for Monarch's ``ca=`` and ``private_key=``).

    Example::

        # on each host (python -m monarch_kernel.agent --listen ... does the same):
        run_worker_loop_forever(address="tcp://0.0.0.0:29500", key="~/.mk-key")
    """
    if key is None:
        raise TypeError(worker_key.no_key("run_worker_loop_forever(address=..., key=PATH)", ca, private_key))
    ip, port = parse_listen(address)
    if os.path.isdir(os.path.expanduser(os.fspath(key))):
        raise IsADirectoryError(f"--key-file {key} is a folder: give the key file itself, e.g. --key-file "
                                f"{os.path.join(str(key), 'mk.key')} (make one with  python -m monarch_kernel key "
                                f"new PATH)")
    secret = worker_key.read_key_file(key)
    diagnostics.install()
    logging.getLogger(__name__).setLevel(logging.INFO)
    asyncio.run(Worker(ip, port, secret).serve())
