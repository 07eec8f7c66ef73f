"""This process's links to other hosts: whether and where it listens on TCP, the job's
Curve keys and the ZAP handler that checks them, and which of a peer's addresses to use.

A process starts with local (ipc) inboxes only; ``listen_network`` gives every inbox a TCP
address as well, served with CurveZMQ.  Nothing here sends or reads a message.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import PortTaken
from ..wire import rejects
from ..wire.auth import DropCounts
from ..wire.curve import CurveKeys, Gatekeeper
from .inbox import Inbox
from .io_thread import IOThread

log = logging.getLogger("monarch_kernel.runtime")
PORT_TRIES = 8  # ports a new inbox tries before a hook's PortTaken reaches its caller


class Network:
    def __init__(self, ctx: zmq.Context, io: IOThread, drops: DropCounts, curve: CurveKeys | None, *,
                 vouched: Callable[[bytes, bytes], bool], on_keys: Callable[[CurveKeys], None] | None = None):
        """``vouched``: the signer's check of a same-host message's first piece (every inbox
        takes it); ``on_keys(curve)``: told when the keys change (the transport's client keys)."""
        self.ctx = ctx
        self.io = io
        self.drops = drops
        self.curve = curve
        self.vouched = vouched
        self.gatekeeper: Gatekeeper | None = None
        self.bind_ip: str | None = None  # set once this process has TCP inboxes
        self.main: Inbox | None = None  # the process's main inbox (set by the runtime)
        self.on_keys = on_keys or (lambda curve: None)
        self._monitor: zmq.Socket | None = None  # the main inbox's ZeroMQ events (watch_refusals)
        self._tcp: list[str] = []  # every TCP address this process listens on, oldest first
        self._on_listen: list[Callable[[str], None]] = []

    def add_listen_hook(self, hook: Callable[[str], None]) -> Callable[[], None]:
        """``hook(address)`` hears each TCP address this process starts listening on, before
        the address is handed to anyone (an ssh forward is set up there).  Returns its remover."""
        self._on_listen.append(hook)
        return lambda: self._on_listen.remove(hook) if hook in self._on_listen else None

    def tcp_addresses(self) -> list[str]:
        """The TCP addresses this process listens on so far."""
        return list(self._tcp)

    def _listened(self, inbox: Inbox) -> str:
        """``inbox``'s TCP address, told to the listen hooks first if it is new.  A hook that
        cannot have its port at the far end of its forward (``PortTaken``: a program on that host
        holds it) makes the inbox listen at another port, which every hook is told instead."""
        for tries_left in range(PORT_TRIES - 1, -1, -1):
            address = inbox.net_address
            assert address is not None
            if address in self._tcp:
                return address
            self._tcp.append(address)
            try:
                for hook in list(self._on_listen):
                    hook(address)
            except PortTaken as e:
                self._tcp.remove(address)
                if not tries_left:
                    raise PortTaken(f"{e} ({PORT_TRIES} ports tried)") from e
                log.info("listening at another port: %s", e)
                inbox.relisten_tcp()
                continue
            return address
        raise AssertionError("unreachable")

    def guard(self) -> None:
        """Start the ZAP handler before the first TCP bind, so no connection is let in unchecked."""
        curve = self.curve
        assert curve is not None, "a TCP inbox needs the job's Curve keys"

        def start():
            if self.gatekeeper is None:
                self.gatekeeper = Gatekeeper(self.ctx, self.io.loop, curve, lambda _addr: self.drops.count("curve"))

        self.io.run(start)

    def main_inbox(self, address: str) -> Inbox:
        """The process's main inbox at ``address``; a TCP address makes this a process on
        another host, every inbox of which is TCP."""
        tcp = address.startswith("tcp://")
        if tcp:
            self.guard()
        self.main = Inbox(self.ctx, address, self.curve, vouched=self.vouched)
        if tcp:
            self.bind_ip = self.main.net_ip
        self.io.call_soon(self._watch_refusals, self.main)
        return self.main

    def _watch_refusals(self, inbox: Inbox) -> None:
        """On the IO thread: count the connections ZeroMQ ends on the main inbox (the one
        every process of the job, and anyone else on the host, can reach).  ZeroMQ gives no
        reason beyond the event: a connection that ends is a peer that closed, or one whose
        frame was over ``max_wire_frame`` (ZMQ_MAXMSGSIZE) or whose bytes were not ZMTP."""
        self._monitor = inbox.sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        self.io.loop.add_reader(int(self._monitor.get(zmq.FD)), self._events, inbox.address)
        self._events(inbox.address)

    def _events(self, default: str) -> None:
        mon = self._monitor
        while mon is not None:
            try:
                got = parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            except zmq.ZMQError:  # the context is ending
                return
            event = got["event"]
            # The endpoint the connection came in on: the inbox listens at its ipc address
            # and, once the process has hosts, at a TCP one too (``listen``).
            address = _endpoint(got.get("endpoint")) or default
            if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                rejects.count("zmq", "not_zmtp", f"a connection to {address} did not speak ZMTP")
            else:  # normal too (a peer exits, a thread's socket closes): logged at DEBUG only
                rejects.count("zmq", "disconnected",
                              f"a connection to {address} ended (the peer closed it, its handshake failed, or "
                              "ZeroMQ refused a frame over MONARCH_KERNEL_MAX_WIRE_FRAME)", logging.DEBUG)

    def thread_inbox(self, base: str, n: int) -> Inbox:
        """The ``n``-th thread's reply inbox of the process whose main inbox is ``base``."""
        if base.startswith("tcp://"):  # a process on another host: TCP only
            return Inbox(self.ctx, f"tcp://{self.bind_ip}:*", self.curve, vouched=self.vouched)
        inbox = Inbox(self.ctx, f"{base}.t{n}", vouched=self.vouched)
        if self.bind_ip is not None:  # it listens for other hosts too
            try:
                inbox.listen_tcp(self.bind_ip, self.curve)
                self._listened(inbox)
            except BaseException:
                inbox.close()
                raise
        return inbox

    def actor_inbox(self, address: str) -> Inbox:
        """An actor's own inbox: at ``address`` (local), or on a port of its own (TCP)."""
        if address.startswith("tcp://"):
            return Inbox(self.ctx, f"tcp://{self.bind_ip}:*", self.curve, vouched=self.vouched)
        return Inbox(self.ctx, address, vouched=self.vouched)

    @property
    def net_address(self) -> str | None:
        """The main inbox's TCP address, once this process listens for other hosts."""
        return self.main.net_address if self.main is not None else None

    def listen(self, ip: str, curve: CurveKeys | None = None) -> str:
        """Listen for processes on other hosts too: the main inbox gets a TCP address on
        ``ip``, a CurveZMQ server with the job's keys (made here unless given); later inboxes
        follow.  Returns the main inbox's TCP address.  A later call returns the same, unless
        that one is of the loopback and ``ip`` is not, or its IP has left this machine (a
        network that is gone): then the process moves to ``ip``, and its old addresses stay
        bound for the peers that hold them (this machine reaches ``ip`` too).  It cannot move
        off the loopback while listen hooks forward it to other hosts (ssh tunnels): their
        processes know this process by that address alone."""
        assert self.main is not None
        old = self.main.net_ip
        if old is not None and self.main.net_address is not None and not _moves(old, ip):
            return self.main.net_address
        if old is not None and self._on_listen and _loopback(old):
            raise ConnectionError(
                f"this controller listens on {old} only, for its jobs whose hosts reach it through ssh (they "
                f"hold that address), so hosts that would reach it directly at {ip} cannot join it: pass "
                "out_of_cluster=True for this job too (login= for a SlurmJob), or kill those jobs first")
        if self.curve is None:
            self.set_keys(curve or CurveKeys.generate())
        self.guard()
        self.bind_ip = ip
        with self.main.lease:
            self.main.listen_tcp(ip, self.curve)
            return self._listened(self.main)

    def set_keys(self, curve: CurveKeys) -> None:
        self.curve = curve
        self.on_keys(curve)

    def use_job_keys(self, curve: CurveKeys) -> None:
        """Take another job's Curve keys as this process's own (attaching to a detached mesh
        on a job's hosts).  Only before this process listens for other hosts: its links there
        would otherwise hold the old keys."""
        if curve == self.curve:
            return
        if self.net_address is not None:
            raise RuntimeError("this process already has hosts of its own, whose links use its own keys")
        self.set_keys(curve)

    def answerable(self, inbox: Inbox, dest: str) -> str:
        """The address of ``inbox`` a peer at ``dest`` can answer: its TCP one for a TCP peer."""
        if dest[:4] == "tcp:" and inbox.net_ip != self.bind_ip and self.bind_ip is not None:
            with inbox.lease:
                inbox.listen_tcp(self.bind_ip, self.curve)
                self._listened(inbox)
        return inbox.net_address if dest[:4] == "tcp:" and inbox.net_address else inbox.address

    def port_address(self, address: str) -> str:
        """Where the ports of the process at ``address`` are reached.  A port travels,
        pickled, to whoever may answer it: once this process listens for other hosts it names
        both of its addresses (``ipc://...|tcp://...``) and each sender takes the one it can
        reach (``reach``), so ranks on this host keep using the local link."""
        net = self.net_address
        return f"{address}|{net}" if net and net != address else address

    @staticmethod
    def reach(own: str, address: str) -> str:
        """Which of a port's addresses the process at ``own`` sends to: the TCP one from a
        process on another host (whose own address is TCP), else the local one."""
        if "|" not in address:
            return address
        local, net = address.split("|", 1)
        return net if own.startswith("tcp://") else local

    def job_ports_for(self, job_ports: dict, own: str, dest: str) -> dict:
        """``job_ports`` (opened at ``own``) as a process at ``dest`` can reach them."""
        if dest[:4] != "tcp:" or self.net_address is None:
            return dict(job_ports)
        return {k: (self.net_address if a == own else a, p) for k, (a, p) in job_ports.items()}


def _moves(old: str, new: str) -> bool:
    """Whether a process listening on ``old`` listens on ``new`` instead (``Network.listen``)."""
    if old == new:
        return False
    if _loopback(old) and not _loopback(new):
        return True
    family = socket.AF_INET6 if ":" in old else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((old.strip("[]"), 0))
        except OSError:  # EADDRNOTAVAIL: no interface has it any more
            return True
    return False


def _loopback(ip: str) -> bool:
    try:
        return ipaddress.ip_address(ip.strip("[]")).is_loopback
    except ValueError:
        return False


def _endpoint(raw) -> str | None:
    """A monitor event's endpoint as text (ZeroMQ gives bytes), cut to a sane length."""
    if not raw:
        return None
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    return text[:200]
