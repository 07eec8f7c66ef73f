"""Coverage-guided fuzzing (atheris, libFuzzer) of the wire decoders that read another
process's bytes.  The first input byte picks the decoder, the rest is its input; a decoder
that raises anything but its own documented error is a crash, which libFuzzer reports with
the input that caused it.  ``tests/runtime/test_fuzz_wires.py`` runs this for a few seconds;
by hand: ``python tests/atheris_wires.py -max_total_time=600 [corpus dir]``.
"""

from __future__ import annotations

import json
import sys

import atheris

_MODULES = [
    "monarch_kernel.runtime.wire.envelope",
    "monarch_kernel.runtime.wire.payloads",
    "monarch_kernel.runtime.wire.framing",
    "monarch_kernel.runtime.wire.auth",
    "monarch_kernel.runtime.spawn.host_messages",
    "monarch_kernel.runtime.spawn.template_channel",
    "monarch_kernel.data.wire",
    "monarch_kernel.debug.dap",
    "monarch_kernel.debug.messages",
    "monarch_kernel.kernel.panel.messages",
]

with atheris.instrument_imports(include=_MODULES):
    from monarch_kernel.data import wire as data_wire
    from monarch_kernel.debug import messages
    from monarch_kernel.debug.dap import FrameError, FrameReader
    from monarch_kernel.kernel.panel.messages import MessageError, Request
    from monarch_kernel.runtime.spawn import host_messages, template_channel
    from monarch_kernel.runtime.wire import framing
    from monarch_kernel.runtime.wire.auth import Dropped, Signer
    from monarch_kernel.runtime.wire.envelope import Header

_SIGNER = Signer(b"k" * 32, wire=False)
_NATIVE = None
try:
    _NATIVE = Signer(b"k" * 32, wire=True)
except RuntimeError:  # the C extension is not built here
    pass


def _frames(data: bytes) -> list[bytes]:
    """Split the input into frames at every 0xFF 0x00 pair (so the fuzzer can make several)."""
    return data.split(b"\xff\x00")


def _json(data: bytes):
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def _header(data: bytes) -> None:
    try:
        Header.decode(data)
    except ValueError:
        pass


def _open(data: bytes) -> None:
    for signer in (_SIGNER, _NATIVE):
        if signer is not None:
            try:
                signer.open(_frames(data))
                raise AssertionError("fuzzed bytes opened as a signed message")
            except Dropped:
                pass


def _unpack(data: bytes) -> None:
    try:
        framing.unpack(_frames(data))
    except Dropped:
        pass


def _host(data: bytes) -> None:
    try:
        host_messages.decode(data)
    except host_messages.MalformedMessage:
        pass


def _control(data: bytes) -> None:
    reader = template_channel.ControlReader()
    for i in range(0, len(data), 7):
        reader.feed(data[i:i + 7])


def _data(data: bytes) -> None:
    raw = data[:data_wire.REQUEST.size].ljust(data_wire.REQUEST.size, b"\0")
    data_wire.Request.decode(raw)
    try:
        data_wire.decode_reply_head(data[:data_wire.REPLY.size].ljust(data_wire.REPLY.size, b"\0"))
    except data_wire.ProtocolError:
        pass


def _dap(data: bytes) -> None:
    reader = FrameReader()
    try:
        for i in range(0, len(data), 13):
            reader.feed(data[i:i + 13])
    except FrameError:
        pass


def _messages(data: bytes) -> None:
    obj = _json(data)
    for decode in (messages.decode, messages.decode_tunnel, messages.Reply.decode, messages.RankHost.decode):
        try:
            decode(obj)
        except ValueError:
            pass
    messages.decode_dap(obj)


def _panel(data: bytes) -> None:
    try:
        Request.decode(_json(data))
    except MessageError:
        pass


DECODERS = [_header, _open, _unpack, _host, _control, _data, _dap, _messages, _panel]


def one_input(data: bytes) -> None:
    if data:
        DECODERS[data[0] % len(DECODERS)](data[1:])


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
