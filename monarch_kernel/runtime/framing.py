"""How a signed message rides in ZeroMQ frames: the MAC, the header and the small parts
packed into the first frame, large buffers after it as frames of their own.

ZeroMQ's cost is per frame (each is queued, framed and read on its own); a small call is one
frame.  ``pack`` and ``unpack`` move between this layout and the logical one ``Signer``
signs and checks, ``[mac, header, part frames...]``; nothing here checks or unpickles.  A
message whose first frame is exactly the 32-byte MAC is taken in the logical layout as it
is (what tools and tests write by hand).
"""

from __future__ import annotations

import struct

from .auth import MAC_LEN, Dropped

INLINE_MAX = 1 << 16  # body frames below this, up to this much in all, ride in the first frame
_HEAD = struct.Struct("<IH")  # header length, number of inlined body frames


def pack(frames: list) -> list:
    """``[mac, header, body...]`` -> ``[first, large...]``."""
    mac, hb = frames[0], frames[1]
    inline: list = []
    total = 0
    for f in frames[2:]:
        n = f.nbytes if type(f) is memoryview else len(f)
        if n >= INLINE_MAX or total + n > INLINE_MAX:
            break
        inline.append(f)
        total += n
    lens = [f.nbytes if type(f) is memoryview else len(f) for f in inline]
    first = b"".join([mac, _HEAD.pack(len(hb), len(inline)), struct.pack(f"<{len(lens)}I", *lens), hb, *inline])
    return [first, *frames[2 + len(inline):]]


def unpack(frames: list) -> list:
    """``[first, large...]`` (zmq Frames or buffers) -> ``[mac, header, body...]`` as
    memoryviews over the received bytes; ``Dropped`` when the first frame cannot be cut."""
    first = frames[0]
    buf = first.buffer if hasattr(first, "buffer") else memoryview(first)
    if buf.nbytes <= MAC_LEN:
        return frames  # the logical layout, or too short to be anything: Signer says which
    at = MAC_LEN + _HEAD.size
    if buf.nbytes < at:
        raise Dropped("malformed")
    hlen, n = _HEAD.unpack_from(buf, MAC_LEN)
    lens = struct.unpack_from(f"<{n}I", buf, at) if buf.nbytes >= at + 4 * n else None
    if lens is None:
        raise Dropped("malformed")
    at += 4 * n
    end = at + hlen + sum(lens)
    if end != buf.nbytes:
        raise Dropped("truncated" if end > buf.nbytes else "malformed")
    out = [buf[:MAC_LEN], buf[at:at + hlen]]
    at += hlen
    for k in lens:
        out.append(buf[at:at + k])
        at += k
    out.extend(frames[1:])
    return out
