"""How a signed message rides in ZeroMQ frames: the MAC, the header and the small parts
packed into the first frame, large buffers after it as frames of their own (one of CHUNK
bytes or more as pieces that each fit under a receiver's ZMQ_MAXMSGSIZE: ``pieces``/``join``).

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
# A frame of this size or more goes as pieces of exactly CHUNK bytes and a last, shorter (maybe
# empty) one: every ZeroMQ frame then fits under an inbox's ZMQ_MAXMSGSIZE
# (``config.max_wire_frame``), and a frame of exactly CHUNK bytes always means "continued".
# Larger than the 64 MiB tensors of the benchmarks and most arguments, so those still arrive
# as one frame with no copy; four times smaller than the 1 GiB frame an inbox must refuse.
CHUNK = 256 << 20
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
    if not frames:  # (ZeroMQ never delivers none; a caller that passes none gets a drop)
        raise Dropped("unsigned")
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


def pieces(f) -> list:
    """``f`` (a frame of CHUNK bytes or more) as the ZeroMQ frames that carry it: zero-copy
    views of CHUNK bytes each, then the rest (empty when the size is a multiple of CHUNK)."""
    view = memoryview(f).cast("B") if not isinstance(f, memoryview) or f.format != "B" or f.ndim != 1 else f
    n = view.nbytes
    return [view[i:i + CHUNK] for i in range(0, n - n % CHUNK, CHUNK)] + [view[n - n % CHUNK:]]


def join(frames: list) -> list:
    """Received ZeroMQ frames with every run of CHUNK-sized pieces (and the piece after it)
    joined back into one frame.  A run the message ends in is joined as it is (a sender
    cut short): the MAC check then refuses it."""
    out: list = []
    run: list = []
    for f in frames:
        run.append(f)
        if len(f) != CHUNK:
            if len(run) == 2 and not len(f):  # a frame of exactly CHUNK bytes: no copy
                run.pop()
            out.append(run[0] if len(run) == 1 else b"".join(_view(p) for p in run))
            run = []
    if run:
        out.append(b"".join(_view(p) for p in run))
    return out


def _view(f):
    return f.buffer if hasattr(f, "buffer") else f
