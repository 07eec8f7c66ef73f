"""Malformed, truncated, oversized and forged bytes on every decoder that reads what another
process sent, in process, with hypothesis: the envelope and its framing (both the C and the
Python path), the template's and agents' messages, a rank's control pipe, the data plane's
requests and replies, the DAP stream and its tunnel, pdb messages, the panel's requests, the
REST body, and the worker wire's messages and session frames.  Each decoder either returns a
value of its type or raises its one documented error; rejections are counted on the
process's ``rejects`` registry."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import pickle
import secrets
import socket
import struct
import subprocess
import sys

import msgpack
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from monarch_kernel.agent import worker_wire
from monarch_kernel.data import wire as data_wire
from monarch_kernel.debug import messages as debug_messages
from monarch_kernel.debug.dap import DapClient, FrameError, FrameReader, encode
from monarch_kernel.kernel.panel.messages import MessageError, Request
from monarch_kernel.runtime.spawn import agent_channel, host_messages, template_channel
from monarch_kernel.runtime.wire import framing, rejects
from monarch_kernel.runtime.wire.auth import MAC_LEN, Dropped, Signer
from monarch_kernel.runtime.wire.envelope import Header, Kind, Part, Status, join_parts
from monarch_kernel.runtime.wire.payloads import PAYLOADS, decode_payload

pytestmark = pytest.mark.timeout(60)

KEY = secrets.token_bytes(32)
REASONS = {"unsigned", "forged", "truncated", "oversized", "malformed"}


def fuzz(n: int):
    """hypothesis settings for one decoder: ``n`` examples, no per-example deadline (the
    suite shares two cores), no database written into the checkout."""
    return settings(max_examples=n, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# JSON-like values: what a comm message, a DAP body or a REST body can decode to.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=25)
# msgpack-able values, bytes included: what a header field or a host_wire field can be.
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


def _wires() -> list[str]:
    from monarch_kernel.runtime.wire import native

    return ["python"] + (["native"] if native.wire() is not None else [])


# ---------------------------------------------------------------- the registry


def test_rejections_are_counted_by_wire_and_reason_and_logged_at_powers_of_two(caplog):
    reg = rejects.Rejects()
    with caplog.at_level(logging.INFO, logger="monarch_kernel"):
        for _ in range(9):
            reg.count("panel", "malformed", "a test")
        reg.count("dap", "oversized", level=logging.INFO)
    said = [r.getMessage() for r in caplog.records if r.name == "monarch_kernel.rejects"]
    assert said == [f"monarch_kernel: rejected input on the panel wire (malformed): a test; {n} so far"
                    for n in (1, 2, 4, 8)] + ["monarch_kernel: rejected input on the dap wire (oversized); 1 so far"]
    assert reg.snapshot() == {("panel", "malformed"): 9, ("dap", "oversized"): 1}


def test_the_runtime_reports_every_wires_rejections_in_its_stats():
    from monarch_kernel.runtime.process import Runtime

    rt = Runtime.current()
    before = rt.stats()
    rt.receiver.handle([b"not a message"], False)  # what its inbox would hand it
    after = rt.stats()
    assert after["dropped"]["unsigned"] == before["dropped"]["unsigned"] + 1
    assert after["rejected"]["envelope/unsigned"] == before["rejected"].get("envelope/unsigned", 0) + 1


# ---------------------------------------------------------------- the envelope


@fuzz(150)
@given(st.binary(max_size=512) | msgpack_values.map(lambda v: msgpack.packb(v, use_bin_type=True)))
@example(b"\xc1")
@example(msgpack.packb([2] + [0] * 13))
def test_header_decode_raises_only_value_error(data):
    try:
        h = Header.decode(data)
    except ValueError:
        return
    assert isinstance(h.kind, int) and all(len(p) == 3 for p in h.parts)


@fuzz(100)
@given(st.sampled_from(sorted(PAYLOADS)), msgpack_values)
def test_payloads_decode_raises_only_value_error(kind, raw):
    try:
        decode_payload(kind, raw)
    except ValueError:
        pass


def _good_message(signer: Signer) -> list:
    h = Header(Kind.CALL, 7, "ipc:///o", "ipc:///o", "m", "a", "f", [0])
    body = join_parts(h, [Part(-1, Status.OK, [pickle.dumps(((1,), {})), b"b" * 70_000])])
    return signer.seal(h, body)


mutations = st.lists(st.tuples(st.sampled_from(["flip", "cut", "drop", "add", "swap"]),
                               st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4)


def _mutate(frames: list, ops) -> list:
    frames = [bytearray(f) for f in frames]
    for op, at, byte in ops:
        if not frames:
            frames = [bytearray()]
        i = at % len(frames)
        f = frames[i]
        if op == "flip" and f:
            f[at % len(f)] ^= (byte or 1)
        elif op == "cut":
            frames[i] = f[: at % (len(f) + 1)]
        elif op == "drop" and len(frames) > 1:
            del frames[i]
        elif op == "add":
            frames.insert(i, bytearray([byte]) * (at % 64))
        elif op == "swap" and len(frames) > 1:
            frames[0], frames[-1] = frames[-1], frames[0]
    return [bytes(f) for f in frames]


@pytest.mark.parametrize("path", _wires())
def test_any_change_to_a_sealed_message_is_dropped_for_a_known_reason(path):
    signer = Signer(KEY, wire=path == "native")
    good = _good_message(signer)
    assert signer.open(good)[0].call_id == 7

    @fuzz(300)
    @given(mutations)
    def check(ops):
        bad = _mutate(good, ops)
        try:
            header, body = signer.open(bad)
        except Dropped as d:
            assert d.reason in REASONS
            return
        # Only a change that changed nothing (a cut at the very end, a no-op flip) opens.
        assert [bytes(f) for f in bad] == [bytes(f) for f in good] and header.call_id == 7

    check()


@pytest.mark.parametrize("path", _wires())
def test_garbage_frames_open_as_dropped_never_anything_else(path):
    signer = Signer(KEY, wire=path == "native")

    @fuzz(300)
    @given(st.lists(st.binary(max_size=300), min_size=0, max_size=6))
    @example([])
    @example([b"\0" * MAC_LEN])
    @example([b"\0" * (MAC_LEN + 6)])
    @example([b"\0" * MAC_LEN + struct.pack("<IH", 0, 0xFFFF)])
    def check(frames):
        try:
            signer.open(frames)
        except Dropped as d:
            assert d.reason in REASONS
        else:
            raise AssertionError("garbage opened as a message")

    check()


@pytest.mark.parametrize("path", _wires())
def test_forged_pickles_are_never_loaded(tmp_path, path):
    """A message whose MAC fails is dropped before its pickle is touched: the pickle here
    creates a file when loaded, and no file appears, whichever way the message is bent."""
    target = tmp_path / "pwned"
    payload = pickle.dumps(_Creates(str(target)), protocol=5)
    forger = Signer(secrets.token_bytes(32))
    h = Header(Kind.CALL, 1, "o", "o", "m", "a", "f", [0])
    forged = forger.seal(h, join_parts(h, [Part(-1, Status.OK, [payload])]))
    signer = Signer(KEY, wire=path == "native")

    @fuzz(60)
    @given(mutations)
    def check(ops):
        with pytest.raises(Dropped):
            signer.open(_mutate(forged, ops))

    check()
    with pytest.raises(Dropped, match="forged"):
        signer.open(forged)
    assert not target.exists()


class _Creates:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@fuzz(200)
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_framing_unpack_cuts_or_drops(frames):
    try:
        out = framing.unpack(frames)
    except Dropped as d:
        assert d.reason in ("unsigned", "malformed", "truncated")
        return
    assert isinstance(out, list)


@fuzz(50)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=5), st.integers(0, 300))
def test_pieces_join_back_to_the_frames_they_came_from(multiples, extra):
    """A frame of CHUNK bytes or more travels as pieces; the receiver joins them back, and a
    frame of exactly CHUNK bytes is told apart from a piece by the one after it."""
    small = 64  # CHUNK itself is 64 MiB: shrink it for this check
    old, framing.CHUNK = framing.CHUNK, small
    try:
        frames = [os.urandom(m * small + (extra if i % 2 else 0)) for i, m in enumerate(multiples)]
        sent = []
        for f in frames:
            sent += [bytes(p) for p in framing.pieces(f)] if len(f) >= small else [f]
        assert all(len(p) <= small for p in sent)
        assert [bytes(f) for f in framing.join(sent)] == frames
        framing.join(sent[:-1])  # cut short: joined as it is, never an error
    finally:
        framing.CHUNK = old


# ---------------------------------------------------------------- template and agent messages


@fuzz(60)
@given(st.binary(max_size=300) | st.lists(msgpack_values, max_size=8).map(lambda v: msgpack.packb(v)))
def test_host_wire_decode_raises_only_malformed_message(data):
    try:
        msg = host_messages.decode(data)
    except host_messages.MalformedMessage:
        return
    assert isinstance(msg, host_messages.Message)
    assert host_messages.decode(msg.encode()) == msg


@fuzz(60)
@given(st.sampled_from(sorted(host_messages.OPS)), st.lists(msgpack_values, max_size=7))
def test_every_op_with_any_fields_decodes_or_is_malformed(op, values):
    try:
        host_messages.decode(msgpack.packb([op, *values], use_bin_type=True))
    except host_messages.MalformedMessage:
        pass


@fuzz(200)
@given(st.lists(st.binary(max_size=100), max_size=3))
def test_agent_wire_decode_of_any_body(body):
    h = Header(Kind.HOST, 0, "o", "o", "host", parts=[[0, 0, len(body) - 1]] if body else [])
    msg = agent_channel.decode(h, body)
    assert msg is None or isinstance(msg, host_messages.Message)


# ---------------------------------------------------------------- the worker wire (agent --listen)


@fuzz(60)
@given(st.binary(max_size=300) | st.lists(msgpack_values, max_size=8).map(lambda v: msgpack.packb(v)))
def test_worker_wire_decode_raises_only_malformed_message(data):
    try:
        msg = worker_wire.decode(data)
    except host_messages.MalformedMessage:
        return
    assert type(msg) in worker_wire.OPS.values()
    assert worker_wire.decode(msg.encode()) == msg


@fuzz(100)
@given(st.binary(min_size=4, max_size=4), st.binary(max_size=64), st.integers(0, 3))
def test_worker_session_frames_are_checked_before_they_are_decoded(head, body, tamper):
    """A frame's length is refused past the limit before its body is read; a body that the
    other side did not sign as its next one (forged, replayed, reordered) is refused before
    it is decoded."""
    session = secrets.token_bytes(32)
    try:
        n = worker_wire.Codec.length(head)
    except host_messages.MalformedMessage:
        assert struct.unpack("<I", head)[0] > worker_wire.MAX_MESSAGE
    else:
        assert n <= worker_wire.MAX_MESSAGE
    worker, controller = worker_wire.Codec(session, worker=True), worker_wire.Codec(session, worker=False)
    first, second = (controller.pack(m) for m in (worker_wire.Attach("x"), worker_wire.Release()))
    sig, good = first[4:4 + worker_wire.MAC], first[4 + worker_wire.MAC:]
    forged = [(sig, body), (secrets.token_bytes(worker_wire.MAC), good),  # another body; another MAC
              (second[4:4 + worker_wire.MAC], second[4 + worker_wire.MAC:]),  # out of order
              (worker.pack(worker_wire.Attach("x"))[4:4 + worker_wire.MAC], good)][tamper]  # its own direction
    if forged[1] != good or forged[0] != sig:
        with pytest.raises(worker_wire.HandshakeFailed):
            worker.unpack(*forged)
    assert worker.unpack(sig, good) == worker_wire.Attach("x")
    with pytest.raises(worker_wire.HandshakeFailed):  # the same frame again: a replay
        worker.unpack(sig, good)


def test_template_datagrams_malformed_are_counted_and_fds_closed():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        @fuzz(150)
        @given(st.binary(min_size=1, max_size=200))
        def check(data):
            before = rejects.REJECTS.get("template", "malformed")
            a.send(data)
            try:
                msg, fds = template_channel.recv_msg(b)
            except host_messages.MalformedMessage:
                assert rejects.REJECTS.get("template", "malformed") == before + 1
                return
            assert isinstance(msg, host_messages.Message) and fds == []

        check()
        # A datagram with a descriptor that is no message: the descriptor is closed.
        r, w = os.pipe()
        os.close(w)
        template_channel.send_msg(a, host_messages.Beat(), [r])
        os.close(r)
        a.sendmsg([b"\xc1"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", os.open(os.devnull, 0)))])
        assert template_channel.recv_msg(b)[0] == host_messages.Beat()
        open_before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(host_messages.MalformedMessage):
            template_channel.recv_msg(b)
        assert len(os.listdir("/proc/self/fd")) < open_before + 1
    finally:
        a.close()
        b.close()


@fuzz(200)
@given(st.lists(st.binary(max_size=40), max_size=6), st.lists(st.integers(1, 50), min_size=1, max_size=8))
def test_control_pipe_frames_survive_any_split(frames, cuts):
    """A rank's hello and beats, however the pipe's reads cut them, come out whole."""
    stream = b"".join(len(f).to_bytes(4, "big") + f for f in frames)
    reader, out, at, i = template_channel.ControlReader(), [], 0, 0
    while at < len(stream):
        n = cuts[i % len(cuts)]
        out += reader.feed(stream[at:at + n])
        at, i = at + n, i + 1
    assert out == frames and not reader.broken


def test_control_pipe_frame_over_the_limit_is_refused_before_it_is_buffered():
    reader = template_channel.ControlReader()
    before = rejects.REJECTS.get("template", "oversized")
    assert reader.feed(b"\0\0\0\0" + (1 << 30).to_bytes(4, "big") + b"x" * 100) == [b""]
    assert reader.broken and rejects.REJECTS.get("template", "oversized") == before + 1
    assert reader.feed(b"\0\0\0\0") == []  # nothing after it is read


# ---------------------------------------------------------------- the data plane


@fuzz(300)
@given(st.binary(min_size=data_wire.REQUEST.size, max_size=data_wire.REQUEST.size))
def test_data_requests_decode_from_any_bytes(raw):
    req = data_wire.Request.decode(raw)
    assert req.encode() == raw


@fuzz(300)
@given(st.binary(min_size=data_wire.REPLY.size, max_size=data_wire.REPLY.size))
def test_data_reply_heads_decode_or_are_refused_as_oversized(raw):
    try:
        _status, n = data_wire.decode_reply_head(raw)
    except data_wire.ProtocolError:
        assert struct.unpack("<BI", raw)[1] > data_wire.MAX_MESSAGE
        return
    assert n <= data_wire.MAX_MESSAGE


def test_data_server_checks_any_request_without_raising():
    from monarch_kernel.data.memory import as_memory
    from monarch_kernel.data.server import DataServer

    server = DataServer.get()
    reg = server.register(as_memory(bytearray(100), writable=True, what="a fuzzed buffer"), "fuzzed")
    try:
        @fuzz(300)
        @given(st.integers(0, 255), st.sampled_from([reg.id, 0, 1 << 62]) | st.integers(0, 2**64 - 1),
               st.sampled_from([reg.token]) | st.binary(min_size=16, max_size=16),
               st.integers(-(2**63), 2**64), st.integers(-(2**63), 2**64))
        def check(op, bid, token, offset, nbytes):
            status, why, got = server.check(op, bid, token, offset, nbytes)
            assert (status == data_wire.Status.OK) == (got is not None)
            if status == data_wire.Status.OK:
                assert token == reg.token and 0 <= offset and offset + nbytes <= 100
            else:
                assert why

        check()
    finally:
        server.drop(reg.id)


# ---------------------------------------------------------------- the DAP stream, its tunnel, pdb


@fuzz(300)
@given(st.binary(max_size=200), st.lists(st.integers(1, 64), min_size=1, max_size=5))
@example(b"Content-Length: -5\r\n\r\n{}", [100])
@example(b"Content-Length: 99999999999\r\n\r\n", [100])
@example(b"Content-Length: 2\r\n\r\n[]", [100])
@example(b"Content-Length: 4000\r\n\r\n" + b"[" * 4000, [5000])
def test_dap_frames_of_any_bytes_are_messages_or_a_frame_error(stream, cuts):
    reader, at, i = FrameReader(), 0, 0
    try:
        while at < len(stream):
            n = cuts[i % len(cuts)]
            for msg in reader.feed(stream[at:at + n]):
                assert isinstance(msg, dict)
            at, i = at + n, i + 1
    except FrameError as e:
        assert e.reason in ("malformed", "oversized")


def test_dap_frame_errors_are_counted_and_a_huge_length_is_never_buffered():
    before = rejects.REJECTS.get("dap", "oversized")
    with pytest.raises(FrameError, match="at most"):
        FrameReader().feed(b"Content-Length: %d\r\n\r\n" % (1 << 40))
    with pytest.raises(FrameError, match="header block over"):
        FrameReader().feed(b"x" * 2000)
    assert rejects.REJECTS.get("dap", "oversized") == before + 2
    assert FrameReader().feed(encode({"a": [[[1]]]})) == [{"a": [[[1]]]}]
    with pytest.raises(FrameError, match="not JSON"):
        FrameReader().feed(b"Content-Length: 100000\r\n\r\n" + b"[" * 100000)


@fuzz(60)
@given(st.lists(json_values, max_size=4))
@example([{"type": "response", "request_seq": [1]}, {"type": "event", "event": [], "body": 3}])
def test_dap_client_takes_any_decoded_messages(msgs):
    events: list = []
    client = DapClient("a fuzzed adapter", events.append, None)
    client._received(msgs)  # what a FrameReader or the tunnel hands it
    assert all(isinstance(e, dict) for e in events)


@fuzz(80)
@given(json_values | st.dictionaries(st.sampled_from(["kind", "link", "messages", "reason"]), json_values)
       .map(lambda d: {**d, "kind": d.get("kind", "dap.frames")}))
def test_tunnel_messages_decode_or_raise_value_error(obj):
    try:
        msg = debug_messages.decode_tunnel(obj)
    except ValueError:
        return
    assert type(msg.link) is int
    if isinstance(msg, debug_messages.DapFrames):
        assert isinstance(msg.messages, list)


pdb_fields = ["kind", "mesh", "rank", "session", "filename", "lineno", "function", "reason", "cell", "error",
              "missing", "reply", "output", "stepping"]


@fuzz(60)
@given(st.sampled_from(sorted(debug_messages.RANK_MESSAGES)),
       st.dictionaries(st.sampled_from(pdb_fields[1:]), json_values))
@example("pdb.stopped", {"mesh": "m", "rank": 0, "session": 1, "filename": "f", "lineno": 1, "function": "g",
                         "reason": "breakpoint", "cell": False, "error": "", "missing": 3, "reply": 7})
def test_pdb_messages_decode_or_raise_value_error(kind, obj):
    try:
        msg = debug_messages.decode({**obj, "kind": kind})
    except ValueError:
        return
    assert type(msg.rank) is int and type(msg.mesh) is str


@fuzz(60)
@given(json_values)
def test_pdb_reply_and_rank_host_decode_or_raise_value_error(obj):
    for cls in (debug_messages.Reply, debug_messages.RankHost):
        try:
            cls.decode(obj)
        except ValueError:
            pass


# ---------------------------------------------------------------- the panel and the REST body


request_fields = ["action", "id", "mesh", "rank", "ranks", "since", "n", "name", "detach", "launcher", "hosts",
                  "ssh_args", "nodes", "partition", "time", "account", "full"]


@fuzz(60)
@given(json_values | st.dictionaries(st.sampled_from(request_fields), json_values)
       .map(lambda d: {**d, "action": d.get("action", "spawn")}))
@example({"action": "restart", "mesh": 3})
@example({"action": "interrupt", "ranks": {"a": 1}})
def test_panel_requests_decode_typed_or_raise_message_error(data):
    try:
        req = Request.decode(data)
    except MessageError:
        return
    assert type(req.mesh) is str and type(req.id) is int and type(req.full) is bool
    assert req.ranks is None or all(type(r) is int for r in req.ranks)


@fuzz(50)
@given(st.binary(max_size=100) | json_values.map(lambda v: json.dumps(v).encode()))
@example(b"[" * 100_000)
@example(b'{"kernel_id": ""}')
def test_rest_attach_body_names_a_kernel_or_raises_value_error(body):
    from monarch_kernel_server.handlers import attach_kernel_id

    try:
        kid = attach_kernel_id(body)
    except ValueError as e:
        assert "kernel_id" in str(e)
        return
    assert isinstance(kid, str) and kid


# ---------------------------------------------------------------- coverage-guided, briefly


def test_atheris_finds_no_crash_in_a_short_run(tmp_path):
    """The same decoders under libFuzzer for a few seconds (``tests/atheris_wires.py``; run it
    longer by hand).  A crash would leave its input in ``tmp_path``."""
    pytest.importorskip("atheris", reason="atheris is installed with the test extras on Python 3.11 only")
    script = pathlib.Path(__file__).resolve().parents[1] / "atheris_wires.py"
    out = subprocess.run([sys.executable, str(script), "-runs=5000", "-max_total_time=2",
                          f"-artifact_prefix={tmp_path}/"], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []
