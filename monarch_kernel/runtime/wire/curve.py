"""CurveZMQ for links between hosts: the job's key pairs, and the check that refuses peers
without them.

Every TCP link is encrypted and authenticated with CurveZMQ, on top of the HMAC that signs
every message.  A job has one server key pair (every TCP inbox of the job serves with it)
and one client key pair (every process of the job connects with it); both are made per job
and reach its processes the way the HMAC key does (an agent's stdin, a rank's launch
config).  The ZAP handler runs on the IO thread and lets in only connections that prove the
job's client key; a refusal is counted with the other drops.  Local links (ipc) are left as
they are: a socket file in a 0700 directory is reached only by its owner.
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq
import zmq.utils.z85

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
DOMAIN = b"monarch_kernel"


@dataclass(frozen=True)
class CurveKeys:
    """The job's two Curve key pairs, Z85-encoded (40 ASCII bytes each)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def to_wire(self) -> list:
        return [self.server_public, self.server_secret, self.client_public, self.client_secret]

    @classmethod
    def from_wire(cls, fields) -> CurveKeys:
        return cls(*(bytes(f) for f in fields))

    def serve(self, sock: zmq.Socket) -> None:
        """Make the next TCP bind of ``sock`` a Curve server (earlier binds keep their options)."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, DOMAIN)

    def connect_as_client(self, sock: zmq.Socket) -> None:
        """Make the next connect of ``sock`` speak Curve with the job's client key."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)


class Gatekeeper:
    """The ZAP handler of one process: accepts Curve clients holding the job's client key.

    ``on_refused(address)`` is called (on the IO thread) for every refused connection.
    """

    def __init__(self, ctx: zmq.Context, loop, keys: CurveKeys, on_refused):
        self._client = zmq.utils.z85.decode(keys.client_public)
        self._on_refused = on_refused
        self._loop = loop
        self.sock = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
        loop.add_reader(self.sock.getsockopt(zmq.FD), self._readable)

    def _readable(self) -> None:
        while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 6:
                continue  # REP needs a reply to move on; a malformed request is libzmq's bug
            version, request_id, _domain, address, _identity, mechanism = frames[:6]
            ok = mechanism == b"CURVE" and len(frames) > 6 and frames[6] == self._client
            if not ok:
                self._on_refused(address.decode(errors="replace"))
            status = (b"200", b"OK") if ok else (b"400", b"not a key of this job")
            self.sock.send_multipart([version, request_id, *status, b"", b""])

    def close(self) -> None:
        try:
            self._loop.remove_reader(self.sock.getsockopt(zmq.FD))
        except Exception:  # the loop is already closed
            pass
        self.sock.close(linger=0)
