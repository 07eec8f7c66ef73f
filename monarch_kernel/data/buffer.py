"""``RDMABuffer``: memory on one rank that any other rank reads or writes directly, and the
signed handle that travels in its place.  It must never put the controller on the path of
the bytes, nor trust a handle whose signature does not verify.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import os
from dataclasses import astuple, dataclass

import msgpack

from ..actor.future import Future
from ..runtime import Completion, Runtime, config, hosts
from . import client, cuda_ipc, shm, transfer, wire
from .errors import ForgedHandle, TransferError
from .memory import Memory, as_memory, copy, prefix
from .server import DataServer, Registered
from .transports import choose, get_rdma_backend


@dataclass(frozen=True)
class Handle:
    """Everything a peer needs to reach a registered buffer; signed with the job key."""

    instance: bytes  # the owner's data server; a restarted owner has another
    id: int
    token: bytes  # secret per buffer: knowing the id is not enough
    size: int
    name: str
    owner: str
    pid: int
    host: str
    unix_path: str
    addresses: tuple
    port: int
    device: str
    shared: bool
    ib: object = None
    mac: bytes = b""

    def _fields(self) -> bytes:
        return msgpack.packb(list(astuple(self))[:-1], use_bin_type=True)

    def sign(self, key: bytes) -> Handle:
        return Handle(*(astuple(self)[:-1] + (hmac.new(key, self._fields(), hashlib.sha256).digest(),)))

    def verify(self, key: bytes) -> None:
        good = hmac.new(key, self._fields(), hashlib.sha256).digest()
        if not hmac.compare_digest(good, self.mac):
            raise ForgedHandle(f"the handle of buffer {self.name!r} does not carry a valid "
                               "signature from this job: it was altered or forged")


class ByteSize(int):
    """A byte count that can also be called: ``buf.size`` (this project's spelling) and
    ``buf.size()`` (Monarch's) both give the number of bytes, so code of either kind runs.
    It pickles, and ``size()`` returns, a plain ``int``."""

    __slots__ = ()

    def __call__(self) -> int:
        return int(self)

    def __reduce__(self):
        return int, (int(self),)


class RDMABuffer:
    """Registered memory on its owning rank; a handle to it everywhere else.

    The owner registers contiguous memory; the object is a small signed handle that pickles
    into endpoint arguments and results.  ``read_into``/``write_from`` on any process move
    the bytes between that process and the owner over the best transport for the pair
    (``transports.py``).  Registration lasts until ``drop()`` or the owner's exit, as with
    Monarch: a handle returned from an endpoint stays readable after the endpoint ends.
    ``RDMAAction`` (``action.py``) batches transfers over many buffers.

    Example::

        class Weights(Actor):
            def __init__(self):
                self.w = torch.randn(1 << 20)

            @endpoint
            def handle(self) -> RDMABuffer:
                return RDMABuffer(self.w)

        buf = weights.handle.call_one().get()
        dst = torch.empty(1 << 20)
        await buf.read_into(dst)
    """

    __slots__ = ("_h", "_local", "_server", "_verified", "_via")
    _h: Handle  # frozen, and never replaced: what was verified stays what is used
    _local: Registered | None  # the registration, in the process that registered it
    _server: DataServer | None  # that process's data server
    _verified: bytes | None  # the job key this handle's signature was checked against
    _via: tuple  # (local device, forced transport, transport): chosen once per destination kind

    def __init__(self, data, *, name: str | None = None):
        mem = as_memory(data, writable=False, what="RDMABuffer(data)")
        server = DataServer.get()
        reg = server.register(mem, name)
        h = Handle(server.instance, reg.id, reg.token, mem.nbytes, reg.name, server.owner,
                   server.pid, server.host, server.unix_path, server.addresses, server.tcp_port,
                   mem.device, reg.shared is not None, server.rdma)
        self._h = h.sign(server.key)
        self._local = reg
        self._server = server
        self._verified, self._via = server.key, ()

    @classmethod
    def _from_handle(cls, h: Handle) -> RDMABuffer:
        self = cls.__new__(cls)
        self._h, self._local, self._server = h, None, None
        self._verified, self._via = None, ()
        server = DataServer.running()
        if server is not None and server.instance == h.instance:
            # Back home: serve from the registration itself.
            self._local, self._server = server.buffers.get(h.id), server
        return self

    def __reduce__(self):
        return _rebuild, (astuple(self._h),)

    # ------------------------------------------------------------ facts

    @property
    def size(self) -> ByteSize:
        """Bytes registered: ``buf.size`` or, as in Monarch, ``buf.size()``."""
        return ByteSize(self._h.size)

    @property
    def backend(self) -> str:
        """Monarch's ``RDMABuffer.backend``: ``get_rdma_backend()`` of this process."""
        return get_rdma_backend()

    @property
    def name(self) -> str:
        return self._h.name

    @property
    def owner(self) -> str:
        return self._h.owner

    def transport(self, device: str = "cpu") -> str:
        """The transport a transfer from this process would take (local: same process)."""
        if self._server is not None and self._server.pid == os.getpid():
            return "local"
        return self._transport(device)

    def _transport(self, device: str) -> str:
        """``choose`` for this handle, asked again only when the destination's kind or a
        forced transport changes (the owner's host and device are fixed by its handle)."""
        forced = config.data_transport()
        via = self._via
        if via and via[0] == device and via[1] == forced:
            return via[2]
        got = choose(self._h, device)
        self._via = (device, forced, got)
        return got

    def _verify(self, key: bytes) -> None:
        """Check the handle's signature the first time it is used with ``key``: the handle
        is immutable, so a forged one (another object) is checked at its own first use."""
        if self._verified is not key:
            self._h.verify(key)
            self._verified = key

    def __repr__(self) -> str:
        return f"RDMABuffer<{self._h.name!r} {_human(self._h.size)} on {self._h.owner}>"

    # ------------------------------------------------------------ transfers

    def read_into(self, dst, offset: int = 0, timeout: float | None = None) -> Future[int]:
        """Copy this buffer, from ``offset`` on, into the start of ``dst``; the Future gives
        the bytes copied.  As in Monarch the copy starts when the Future is awaited or read
        (``.get()``), not before; ranges are checked at once.  A larger ``dst`` receives the
        buffer's bytes and keeps the rest (as in Monarch); a smaller one receives the first
        ``dst.nbytes`` of them.

        ``timeout``: seconds the owner may go without progress before ``TimeoutError``
        (None: as long as the owner lives; its death is always an error at once).
        """
        mem = as_memory(dst, writable=True, what="read_into's destination")
        if mem.readonly:
            raise TypeError("read_into's destination is read-only; pass a writable tensor, array or bytearray")
        if isinstance(offset, int) and 0 <= offset <= self._h.size:
            mem = prefix(mem, self._h.size - offset)
        return self._start(wire.Op.READ, mem, offset, timeout)

    def write_from(self, src, offset: int = 0, timeout: float | None = None) -> Future[int]:
        """Copy all of ``src`` into this buffer starting at ``offset``, once the Future is
        awaited or read; a source larger than what fits there is a ``ValueError`` at once
        (as in Monarch)."""
        mem = as_memory(src, writable=False, what="write_from's source")
        return self._start(wire.Op.WRITE, mem, offset, timeout)

    def drop(self) -> Future[None]:
        """Release the registration; later transfers by any holder raise ``BufferDropped``.

        The drop happens whether or not the Future is awaited.  In the owner's process, and
        in synchronous code anywhere, it is done when ``drop()`` returns (a failure raises
        there); in a running event loop (an async endpoint or cell) it is sent without
        blocking the loop, and ``await buf.drop()`` waits for the owner's answer.
        """
        if self._server is not None and self._server.pid == os.getpid():
            self._server.drop(self._h.id)
            return Future.ready(None)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            self._drop_remote()
            return Future.ready(None)
        c = Completion()

        def run():
            try:
                self._drop_remote()
                c.set_result(None)
            except BaseException as e:  # noqa: BLE001 - handed to whoever awaits
                c.set_exception(e)

        transfer.executor().submit(run)
        return Future(c)

    def _drop_remote(self) -> None:
        key = self._key()
        self._verify(key)
        via = "unix" if self._h.host == hosts.host_key() else "tcp"
        with client.Connection(self._h, via, key, 10.0) as sock:
            client.request(sock, self._h, wire.Op.DROP, 0, 0)
        shm.forget(self._h)
        cuda_ipc.forget(self._h)
        # This process's later reads see the owner's cleared word (it was cleared before the
        # owner answered), so they ask the owner and get BufferDropped.

    def _check(self, op: wire.Op, nbytes: int, offset: int) -> None:
        """Raise ``ValueError`` unless ``nbytes`` at ``offset`` lie inside this buffer."""
        h = self._h
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, not {offset!r}")
        if offset + nbytes > h.size:
            verb = "read" if op == wire.Op.READ else "write"
            raise ValueError(f"cannot {verb} {nbytes} bytes at offset {offset} of buffer {h.name!r}, "
                             f"which holds {h.size} bytes (at most {max(h.size - offset, 0)} fit there)")

    def _start(self, op: wire.Op, mem: Memory, offset: int, timeout: float | None) -> Future[int]:
        """Check the range now; the transfer waits for its Future (``_launch``)."""
        self._check(op, mem.nbytes, offset)
        return self._launch(op, mem, offset, timeout)

    def _launch(self, op: wire.Op, mem: Memory, offset: int, timeout: float | None) -> Future[int]:
        """A transfer whose range is already checked, started when its Future is first
        awaited or read, as Monarch's are: a read issued before a write but awaited after it
        sees the written bytes.  In the owner's process it is a copy, done as it starts.
        Elsewhere it runs once every transfer this process started earlier on overlapping
        bytes of this buffer (one of the two a write) has finished."""
        h = self._h
        c = Completion()
        if self._server is not None and self._server.pid == os.getpid():
            def copy_here():
                try:
                    self._local_copy(op, mem, offset)
                    c.set_result(mem.nbytes)
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                    c.set_exception(e)

            return Future(c, start=copy_here)
        key = self._key()
        self._verify(key)

        def run(via: str, threads: int):
            try:
                transfer.transfer(h, key, op, mem, offset, timeout, via, threads)
                c.set_result(mem.nbytes)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                c.set_exception(e)

        def start():
            # In the order they are started, wherever two touch the same bytes (order.py); a
            # bare copy (no round trip) small enough, or for a caller blocked on .get() anyway,
            # runs on the caller's thread.  A transport that cannot serve raises here: the
            # Future raises it.
            via = self._transport(mem.device)
            inline = transfer.bare_copy(h, via, op, mem) and (mem.nbytes <= transfer.INLINE_MAX
                                                              or not transfer.in_event_loop())
            transfer.issue_order().issue((h.instance, h.id), op == wire.Op.WRITE, offset, offset + mem.nbytes,
                                         functools.partial(run, via, config.data_copy_threads()), inline)

        return Future(c, start=start)

    def _local_copy(self, op: wire.Op, mem: Memory, offset: int) -> None:
        assert self._server is not None  # callers check this is the owner's process
        status, why, reg = self._server.check(op, self._h.id, self._h.token, offset, mem.nbytes)
        client.raise_for(self._h, status, why.encode())
        assert reg is not None  # raise_for raised unless the status is OK
        if reg.mem.device != "cpu" or mem.device != "cpu":
            transfer.device_copy(op, reg.mem, mem, offset)
        elif op == wire.Op.READ:
            copy(mem.view, reg.mem.view[offset:offset + mem.nbytes], config.data_copy_threads())
        else:
            copy(reg.mem.view[offset:offset + mem.nbytes], mem.view, config.data_copy_threads())

    @staticmethod
    def _key() -> bytes:
        return Runtime.current().key


def _rebuild(fields) -> RDMABuffer:
    try:
        h = Handle(*fields)
    except TypeError:
        raise TransferError("a malformed RDMABuffer handle arrived (wrong number of fields)") from None
    return RDMABuffer._from_handle(h)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
