"""The one typed wire between a controller and what forks its ranks (templates and host
agents): every message kind round-trips through its msgpack encoding, and through each
transport's framing; anything else is refused with a reason, never unpickled."""

from __future__ import annotations

import os
import pickle
import socket

import msgpack
import pytest

from monarch_kernel.runtime.spawn import agent_channel, host_messages, template_channel
from monarch_kernel.runtime.spawn.host_messages import MalformedMessage

pytestmark = pytest.mark.timeout(60)

EXAMPLES = [
    host_messages.Fork(7, {"rank": 3, "env": {"A": "1"}, "sys_path": ["/src"], "key": b"k" * 32}),
    host_messages.Fork(8, {"rank": 3}, True),
    host_messages.Kill(1234, 9),
    host_messages.Reserve(2, 16),
    host_messages.Stacks(3, [4321, 4322], True),
    host_messages.Drain(5),
    host_messages.Usage(4, [4321]),
    host_messages.Bye(),
    host_messages.Warm([4321, 4322]),
    host_messages.Warmed(["numpy", "torch"]),
    host_messages.Ready(1048576),
    host_messages.Ready(None),
    host_messages.Up("node1", 99, "10.0.0.2", "/usr/bin/python3", "0.1.0"),
    host_messages.Ports(2, [5000, 5001]),
    host_messages.Forked(7, 4321),
    host_messages.ForkFailed(7, "out of file descriptors for a new process: raise it with `ulimit -n`"),
    host_messages.Output([[4321, 1, b"hello\n"], [4321, 2, b"\xff\x00 not utf-8"]]),
    host_messages.Hello(4321, host_messages.RankHello("m1", 3, 4321).encode()),
    host_messages.Beats([4321, 4322]),
    host_messages.StackDump(3, 4321, 0, b'[{"thread_name": "MainThread", "frames": []}]', b""),
    host_messages.Usages(4, [[4321, 1200, 88 << 20, 35, 2048, 12_000_000, 1], [4322, -1, -1, -1, -1, -1, -1]]),
    host_messages.Drained(5),
    host_messages.Exit(4321, 7 << 8),
    host_messages.Beat(),
    host_messages.RankHello("m1", 3, 4321),
    host_messages.RankHello("m1", 0, 5, 1, [b"\x80\x05pickled failure", b""]),
    host_messages.HistoryAsk(6, "trainers", ["lines-1-2-3.parquet"]),
    host_messages.HistoryFile(6, "node1", "lines-4-5-6.parquet", b"PAR1...", False),
    host_messages.HistoryFile(6, "node1", "", b"", True, "the history on node1 could not be read: disk"),
]


def test_every_message_kind_has_an_example():
    assert {type(m) for m in EXAMPLES} == set(host_messages.OPS.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    data = msg.encode()
    assert host_messages.decode(data) == msg
    assert type(msg).decode(data) == msg
    assert host_messages.Message.decode(data) == msg


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_the_agent_framing(msg):
    h, body = agent_channel.encode("h0123456789", "tcp://10.0.0.1:5555", msg)
    assert agent_channel.decode(h, body) == msg


def test_messages_pass_the_template_framing_with_fds():
    here, there = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    try:
        for msg in EXAMPLES:
            template_channel.send_msg(here, msg)
            assert template_channel.recv_msg(there) == (msg, [])
        template_channel.send_msg(here, host_messages.Kill(1, 15), [w])
        msg, fds = template_channel.recv_msg(there)
        assert msg == host_messages.Kill(1, 15) and len(fds) == 1
        os.close(fds[0])
        here.send(msgpack.packb(["kill", "one", 15]))
        with pytest.raises(MalformedMessage, match="field 'pid' of 'kill' is"):
            template_channel.recv_msg(there)
    finally:
        for f in (r, w):
            os.close(f)
        here.close()
        there.close()


@pytest.mark.parametrize("data, why", [
    (b"", "not a msgpack message"),
    (b"\xc1", "not a msgpack message"),
    (msgpack.packb(["exit", 1, 2]) + b"\x00", "not a msgpack message"),
    (msgpack.packb({"op": "exit", "pid": 1, "status": 0}), r"a message is a msgpack list \[op, field, ...\]"),
    (msgpack.packb([]), r"a message is a msgpack list \[op, field, ...\]"),
    (msgpack.packb([3, 1]), r"a message is a msgpack list \[op, field, ...\]"),
    (msgpack.packb(["explode"]), "unknown op 'explode'"),
    (msgpack.packb(["exit", 1]), r"'exit' takes 2 fields \(pid, status\); got 1"),
    (msgpack.packb(["exit", 1, 2, 3]), r"'exit' takes 2 fields \(pid, status\); got 3"),
    (msgpack.packb(["exit", "1", 2]), "field 'pid' of 'exit' is"),
    (msgpack.packb(["exit", True, 2]), "field 'pid' of 'exit' is"),
    (msgpack.packb(["beats", [1, "2"]]), "field 'pids' of 'beats' is"),
    (msgpack.packb(["output", [[1, 1, "text, not bytes"]]]), "field 'items' of 'output' is"),
    (msgpack.packb(["output", [[1, 1]]]), "field 'items' of 'output' is"),
    (msgpack.packb(["fork", 1, pickle.dumps({"rank": 0})]), "field 'config' of 'fork' is"),
    (msgpack.packb(["hello", 1, "not bytes"]), "field 'hello' of 'hello' is"),
], ids=range(16))
def test_malformed_input_is_refused_with_the_reason(data, why):
    with pytest.raises(MalformedMessage, match=why):
        host_messages.decode(data)


def test_a_message_of_another_kind_is_refused_by_the_class_that_expects_one():
    with pytest.raises(MalformedMessage, match="expected a 'rank_hello' message, got 'exit'"):
        host_messages.RankHello.decode(host_messages.Exit(1, 0).encode())


def test_trailing_fields_at_their_defaults_are_not_sent_so_an_older_peer_reads_the_message():
    """A field added with a default (``Fork.standby``) costs nothing on the wire while it is
    left at it: an agent of before the field decodes the message as it always did."""
    assert msgpack.unpackb(host_messages.Fork(7, {"rank": 0}).encode()) == ["fork", 7, {"rank": 0}]
    assert msgpack.unpackb(host_messages.Fork(7, {}, True).encode()) == ["fork", 7, {}, True]
    assert msgpack.unpackb(host_messages.Reserve(2, 16).encode()) == ["reserve", 2, 16]
    assert msgpack.unpackb(host_messages.Reserve(2, 16, False, 5).encode()) == ["reserve", 2, 16, False, 5]
    assert msgpack.unpackb(host_messages.RankHello("m", 1, 2).encode()) == ["rank_hello", "m", 1, 2]


def test_a_malformed_host_message_decodes_to_none():
    h, body = agent_channel.encode("h0", "tcp://10.0.0.1:5555", host_messages.Beat())
    body[-1] = msgpack.packb(["beat", 1, 2])
    assert agent_channel.decode(h, body) is None


def test_messages_are_frozen_records_compared_by_kind_and_values():
    """What a dataclass would give them (they are built without one: it is cheaper to import)."""
    kill = host_messages.Kill(pid=12, signal=9)
    assert kill == host_messages.Kill(12, 9) and hash(kill) == hash(host_messages.Kill(12, 9))
    assert kill != host_messages.Forked(12, 9)  # same values, another kind
    assert repr(kill) == "Kill(pid=12, signal=9)"
    with pytest.raises(AttributeError, match="frozen"):
        kill.pid = 13
    assert host_messages.Reserve(1, 2).check is False  # a default
    a, b = host_messages.RankHello("m", 0, 1), host_messages.RankHello("m", 0, 2)
    assert a.failed_frames == [] and a.failed_frames is not b.failed_frames  # a factory's, made each time
    with pytest.raises(TypeError, match="needs field 'signal'"):
        host_messages.Kill(12)
    with pytest.raises(TypeError, match="no field 'sig'"):
        host_messages.Kill(12, sig=9)
    with pytest.raises(TypeError, match="twice"):
        host_messages.Kill(12, 9, pid=3)
    with pytest.raises(TypeError, match="takes 2 fields"):
        host_messages.Kill(1, 2, 3)
