"""The key a worker (``python -m monarch_kernel.agent --listen``) and its controllers share,
kept in a file that only its owner may read, and what both sides derive from it.

``python -m monarch_kernel key new PATH`` writes one (mode 0600, never over an existing
file); the user copies it to every worker host.  A key file that its group or others may
read is refused, as ssh refuses such a private key: whoever reads it can run code as the
worker's user.  The key itself never leaves the file: the handshake proves it with HMACs
over fresh nonces, and each session's keys (its HMAC key and CurveZMQ key pairs) are
derived from it and both nonces, so a recorded session is of no use to anyone.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

import zmq
import zmq.utils.z85

from ..runtime.hosting import CurveKeys, private_files

PREFIX = "monarch-kernel-key-1 "
KEY_BYTES = 32


class KeyFileError(PermissionError):
    """A key file that cannot be used, saying how to fix it."""


def new_key_file(path: str) -> str:
    """Write a fresh key to ``path`` (which must not exist), mode 0600; returns its path."""
    path = os.path.expanduser(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise FileExistsError(f"{path} exists: a new key would lock out the workers started with it; remove it "
                              "first, or give another path") from None
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(PREFIX + secrets.token_hex(KEY_BYTES) + "\n")
    return path


def read_key_file(path) -> bytes:
    """The key in ``path``; ``KeyFileError`` unless it is a regular file of this user's, mode
    0600, holding a key.  It is opened without following a link and without waiting on a FIFO,
    and checked (``fstat``) before a byte is read."""
    path = os.path.expanduser(os.fspath(path))
    try:
        raw = private_files.read_file(path, limit=4096)
    except FileNotFoundError:
        raise FileNotFoundError(f"no key file at {path}: make one with  python -m monarch_kernel key new {path}  "
                                "and copy it to every worker host") from None
    except private_files.NotPrivate as e:
        if "may be read by others" in str(e):
            raise KeyFileError(f"{e}: whoever reads it can run code as you on every worker") from None
        raise KeyFileError(f"{e}; a key file is a regular file of yours, made by  "
                           f"python -m monarch_kernel key new PATH") from None
    except ValueError:  # over the limit: no key is that long
        raw = b""
    text = raw.decode("ascii", errors="replace").strip()
    if not text.startswith(PREFIX):
        raise KeyFileError(f"{path} is not a monarch-kernel key file; make one with  "
                           f"python -m monarch_kernel key new PATH")
    try:
        key = bytes.fromhex(text[len(PREFIX):])
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise KeyFileError(f"{path} is damaged (its key is not {KEY_BYTES} bytes of hex); make a new one with  "
                           f"python -m monarch_kernel key new PATH  and give it to the workers")
    return key


def no_key(call: str, ca=None, private_key=None) -> str:
    """What to say to a call without ``key=`` (perhaps Monarch's, with ``ca=``)."""
    monarch = " (for Monarch's ca= and private_key=)" if ca is not None or private_key is not None else ""
    return (f"{call}: give key= the path of a key file{monarch}; make one with  python -m monarch_kernel key new "
            "PATH  and copy it to every worker host.  There is no way to run without one: an open worker runs "
            "anyone's code")


def mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` under ``key``, labelled so no two uses can be swapped."""
    return hmac.new(key, label + b"\0" + b"".join(parts), hashlib.sha256).digest()


def session_key(key: bytes, worker_nonce: bytes, controller_nonce: bytes) -> bytes:
    """The key of one session: both nonces make it fresh, so old messages never replay."""
    return mac(key, b"session", worker_nonce, controller_nonce)


def session_curve(session: bytes) -> CurveKeys:
    """The session's CurveZMQ key pairs (the worker serves, the controller connects), which
    only holders of the session key can compute."""
    server_secret = zmq.utils.z85.encode(mac(session, b"curve server"))
    client_secret = zmq.utils.z85.encode(mac(session, b"curve client"))
    return CurveKeys(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)
