"""Wire types round-trip, authentication rejects what it must, and the tree arithmetic the
caller uses to repair a call is consistent with how ranks forward."""

from __future__ import annotations

import pickle
import secrets

import numpy as np
import pytest

from monarch_kernel.runtime.auth import BULK, Dropped, Signer
from monarch_kernel.runtime.envelope import Header, Kind, Mode, Part, Status, join_parts, split_parts
from monarch_kernel.runtime.payloads import (
    PAYLOADS,
    CallInfo,
    DeathNotice,
    InterruptAck,
    PruneInfo,
    ReplyInfo,
    ReviveNotice,
    SpawnInfo,
)
from monarch_kernel.runtime.serialize import dumps
from monarch_kernel.runtime.tree import NodeTable, children, locate, split

pytestmark = pytest.mark.timeout(30)


# One payload of each kind's type; kinds absent carry none.
PAYLOAD_EXAMPLES = {
    Kind.CALL: CallInfo((("gpus", 4),), (0, 1, 2, 3), True),
    Kind.SPAWN: SpawnInfo(True),
    Kind.REPLY: ReplyInfo("act-1", "tcp://10.0.0.2:5555"),
    Kind.PRUNE: PruneInfo(3),
    Kind.DEATH: DeathNotice("m2"),
    Kind.REVIVE: ReviveNotice("m2", 1),
    Kind.INTERRUPT: InterruptAck("ipc:///a", 9),
}


def test_header_round_trip_every_kind():
    for kind in Kind:
        h = Header(kind, 7, "ipc:///a", "ipc:///b", "m1", "act-1", "step", [3, 4, 5], 4,
                   Mode.DIRECT, True, 1, [[3, Status.OK, 2]], PAYLOAD_EXAMPLES.get(kind))
        assert Header.decode(h.encode()) == h
        assert type(Header.decode(h.encode()).payload) is type(PAYLOAD_EXAMPLES.get(kind))


def test_every_payload_type_is_in_the_table_and_every_kind_has_a_handler():
    assert set(PAYLOADS) == set(PAYLOAD_EXAMPLES)
    from monarch_kernel.runtime.process import Runtime

    assert set(Runtime.current().handlers) == set(Kind)


@pytest.mark.parametrize("kind, raw", [
    (Kind.CALL, [[["gpus", "4"]], [0], False]), (Kind.CALL, [[], [0, "1"], False]), (Kind.CALL, [[], [0]]),
    (Kind.SPAWN, [1]), (Kind.REPLY, ["a", "ipc:///not-tcp"]), (Kind.PRUNE, ["3"]),
    (Kind.DEATH, [3]), (Kind.REVIVE, ["m", "1"]), (Kind.INTERRUPT, ["a"]), (Kind.STOP, [1]),
])
def test_a_payload_of_the_wrong_shape_makes_the_header_malformed(kind, raw):
    h = Header(kind, 1, "ipc:///a", "ipc:///a", "m")
    h.payload = raw  # as a forger would write it
    with pytest.raises(ValueError, match="malformed header"):
        Header.decode(h.encode())


@pytest.mark.parametrize("garbage", [b"", b"\x00", b"\x93\x01\x02\x03", pickle.dumps([1, 2]), b"\xc1" * 10])
def test_header_rejects_garbage(garbage):
    with pytest.raises(ValueError, match="malformed header"):
        Header.decode(garbage)


def test_parts_round_trip_with_out_of_band_buffers():
    arr = np.arange(100_000, dtype=np.float32)
    parts = [Part(0, Status.OK, dumps({"a": arr})), Part(1, Status.OK, dumps("small"))]
    h = Header(Kind.REPLY)
    body = join_parts(h, parts)
    assert h.parts == [[0, 0, 1], [1, 0, 0]]  # the array travelled as its own frame
    back = split_parts(Header.decode(h.encode()), body)
    assert np.array_equal(back[0].load()["a"], arr) and back[1].load() == "small"


def test_tensor_travels_out_of_band_and_round_trips():
    torch = pytest.importorskip("torch")
    t = torch.arange(0, 50_000, dtype=torch.bfloat16).reshape(100, 500)
    frames = dumps(t)
    assert len(frames) == 2 and frames[1].nbytes == t.numel() * 2
    back = Part(0, 0, frames).load()
    assert back.dtype == torch.bfloat16 and torch.equal(back, t)
    empty = Part(0, 0, dumps(torch.zeros(0, 3))).load()
    assert empty.shape == (0, 3)


def _signed(signer, body=None):
    body = body if body is not None else dumps(("x", 1))
    h = Header(Kind.CALL, 1, "ipc:///o", "ipc:///o", "m", "a", "f", [0])
    h.parts = [[0, 0, len(body) - 1]]
    return signer.sign(h, body)


def test_sign_verify_and_every_rejection():
    key = secrets.token_bytes(32)
    s = Signer(key)
    frames = _signed(s)
    header, body = s.verify(frames)
    assert header.method == "f" and Part(0, 0, body).load() == ("x", 1)

    def reason(frames, signer=s):
        with pytest.raises(Dropped) as info:
            signer.verify(frames)
        return info.value.reason

    assert reason([b"garbage"]) == "unsigned"
    assert reason([b"short-mac", *frames[1:]]) == "unsigned"
    assert reason(_signed(Signer(secrets.token_bytes(32)))) == "forged"
    tampered = list(frames)
    tampered[2] = dumps(("y", 1))[0]
    assert reason(tampered) == "forged"
    assert reason(frames[:-1]) == "truncated"
    assert reason([frames[0], b"\xc1\xc1", *frames[2:]]) == "malformed"
    assert reason(frames, Signer(key, max_frame=4)) == "oversized"


def test_bulk_buffers_are_bound_by_length():
    s = Signer(secrets.token_bytes(32))
    big = np.zeros(BULK, dtype=np.uint8)
    frames = _signed(s, dumps(big))
    s.verify(frames)
    longer = list(frames)
    longer[3] = bytes(BULK + 1)
    with pytest.raises(Dropped, match="forged"):
        s.verify(longer)


def test_split_covers_every_rank_once():
    for n in range(0, 70):
        for fanout in (1, 2, 3, 8):
            seen = []

            def walk(sub, seen=seen, fanout=fanout):
                seen.append(sub[0])
                for c in children(sub, fanout):
                    walk(c)

            roots = split(list(range(n)), fanout)
            assert len(roots) <= fanout
            for sub in roots:
                walk(sub)
            assert sorted(seen) == list(range(n))


def test_locate_matches_forwarding():
    ranks = list(range(16))
    parent, sub = locate(ranks, 2, 0)
    assert parent is None and sub == list(range(8))
    parent, sub = locate(ranks, 2, 1)
    assert parent == 0 and sub[0] == 1
    assert locate(ranks, 2, 99) is None
    for r in ranks:
        parent, sub = locate(ranks, 2, r)
        if parent is not None:
            assert any(c[0] == r for c in children(locate(ranks, 2, parent)[1], 2))


def test_node_table_redirect_outcomes():
    t = NodeTable()
    key = ("origin", 1)
    assert t.start(key, "parent", True, {0, 5}, False)
    assert not t.start(key, "parent", True, {0}, False)  # a call runs once
    assert t.add(key, 0, [Part(0, 0, [b""])]) is None
    assert t.redirect(key, "origin") == "active"
    st = t.add(key, 5, [Part(5, 0, [b""])])
    assert st.reply_to == "origin" and not st.to_node and len(st.parts) == 2

    key2 = ("origin", 2)
    t.start(key2, "parent", True, {0}, False)
    t.add(key2, 0, [Part(0, 0, [b""])])
    kind, parts = t.redirect(key2, "origin")  # already sent to the dead parent: resend
    assert kind == "resend" and len(parts) == 1

    key3 = ("origin", 3)
    assert t.redirect(key3, "origin") == "lost"
    assert not t.start(key3, "parent", True, {0}, False)  # the late original is refused
    assert t.start(key3, "origin", False, {0}, True)  # the caller's resend runs

    key4 = ("origin", 4)
    t.start(key4, "parent", True, {0, 2}, False)
    st = t.prune(key4, 2)
    assert st is None
    assert t.add(key4, 0, [Part(0, 0, [b""])]).reply_to == "parent"


@pytest.mark.parametrize("body", [[b"small"], [b"a", b"b" * 5000, memoryview(b"c" * 70000), b"tail"], []])
def test_packed_frames_round_trip_to_the_signed_layout(body):
    """Small parts ride in the first frame with the MAC and header; large ones follow as
    frames of their own; unpacking gives back exactly what was signed."""
    from monarch_kernel.runtime.framing import INLINE_MAX, pack, unpack

    s = Signer(secrets.token_bytes(32))
    h = Header(Kind.CALL, 1, "ipc:///o", "ipc:///o", "m", "a", "f", [0])
    h.parts = [[0, 0, len(body) - 1]] if body else []
    logical = s.sign(h, body)
    packed = pack(logical)
    sizes = [f.nbytes if isinstance(f, memoryview) else len(f) for f in body]
    first_big = next((i for i, n in enumerate(sizes) if n >= INLINE_MAX), len(body))
    assert len(packed) == 1 + len(body) - first_big  # the parts before the first large one are inlined
    back = unpack(packed)
    assert [bytes(f) for f in back] == [bytes(f) for f in logical]
    header, _body = s.verify(back)
    assert header.method == "f"


def test_a_packed_first_frame_that_lies_about_its_lengths_is_dropped():
    from monarch_kernel.runtime.framing import pack, unpack

    s = Signer(secrets.token_bytes(32))
    first = pack(_signed(s))[0]
    for cut, reason in ((first[:-1], "truncated"), (first + b"x", "malformed"), (first[:34], "malformed")):
        with pytest.raises(Dropped) as info:
            unpack([cut])
        assert info.value.reason == reason
