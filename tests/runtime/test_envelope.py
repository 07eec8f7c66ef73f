"""Wire types round-trip, authentication rejects what it must, and packed frames keep the
signed layout.  (The tree arithmetic the caller repairs calls with: test_caller.py.)"""

from __future__ import annotations

import pickle
import secrets

import numpy as np
import pytest
from support.config import configured

from monarch_kernel import Actor, endpoint, this_host
from monarch_kernel.runtime.wire.auth import BULK, Dropped, Signer
from monarch_kernel.runtime.wire.envelope import Header, Kind, Mode, Part, Status, join_parts, split_parts
from monarch_kernel.runtime.wire.payloads import (
    PAYLOADS,
    CallInfo,
    DeathNotice,
    InterruptAck,
    MovedNotice,
    PruneInfo,
    ReplyInfo,
    ReviveNotice,
    SpawnInfo,
    StacksAsk,
)
from monarch_kernel.runtime.wire.serialize import dumps

pytestmark = pytest.mark.timeout(30)


# One payload of each kind's type; kinds absent carry none.
PAYLOAD_EXAMPLES = {
    Kind.CALL: CallInfo((("gpus", 4),), (0, 1, 2, 3), True),
    Kind.SPAWN: SpawnInfo(True),
    Kind.REPLY: ReplyInfo("act-1", "tcp://10.0.0.2:5555"),
    Kind.PRUNE: PruneInfo(3),
    Kind.DEATH: DeathNotice("m2"),
    Kind.REVIVE: ReviveNotice("m2", 1),
    Kind.MOVED: MovedNotice("m2", 1, "tcp://10.0.0.2:5555", "tcp://10.0.0.3:6666", "node3"),
    Kind.INTERRUPT: InterruptAck("ipc:///a", 9),
    Kind.STACKS: StacksAsk("ipc:///a", 10),
}


def test_header_round_trip_every_kind():
    for kind in Kind:
        h = Header(kind, 7, "ipc:///a", "ipc:///b", "m1", "act-1", "step", [3, 4, 5], 4,
                   Mode.DIRECT, True, 1, [[3, Status.OK, 2]], PAYLOAD_EXAMPLES.get(kind))
        assert Header.decode(h.encode()) == h
        assert type(Header.decode(h.encode()).payload) is type(PAYLOAD_EXAMPLES.get(kind))


def test_named_constructors_fill_the_fields_their_message_needs_and_round_trip():
    body = [b"args", b"buf"]
    call = Header.call(Kind.CALL, 7, "ipc:///o", "m1", "act-1", "step", body, 4, Mode.GATHER,
                       PAYLOAD_EXAMPLES[Kind.CALL])
    assert (call.reply_to, call.ranks, call.hop, call.resend, call.parts) == ("ipc:///o", [], 0, False,
                                                                              [[-1, Status.OK, 1]])
    fwd = Header.forward(call, [3, 4], "ipc:///node", 1)
    assert (fwd.ranks, fwd.reply_to, fwd.hop, fwd.origin, fwd.parts) == ([3, 4], "ipc:///node", 1, "ipc:///o",
                                                                         call.parts)
    assert Header.forward(fwd, [4]).reply_to == "ipc:///node" and Header.forward(fwd, [4]).hop == 1
    again = Header.resent(fwd, [4])
    assert (again.reply_to, again.hop, again.resend, again.ranks) == ("ipc:///o", 0, True, [4])
    reply = Header.reply(7, "ipc:///o", "ipc:///node", "m1", 3, True, PAYLOAD_EXAMPLES[Kind.REPLY])
    assert (reply.kind, reply.ranks, reply.hop, reply.origin) == (Kind.REPLY, [3], 1, "ipc:///o")
    assert Header.reply(7, "ipc:///o", "ipc:///o", "m1", 3, False).hop == 0
    nack = Header.not_received(fwd, 4)
    assert (nack.kind, nack.call_id, nack.reply_to, nack.ranks) == (Kind.NOT_RECEIVED, 7, "ipc:///o", [4])
    ctl = Header.control(Kind.INTERRUPT, "ipc:///o", "m1", [2], actor="act-1",
                         payload=PAYLOAD_EXAMPLES[Kind.INTERRUPT])
    assert (ctl.origin, ctl.reply_to, ctl.actor, ctl.ranks, ctl.call_id) == ("ipc:///o", "ipc:///o", "act-1", [2], 0)
    assert Header.control(Kind.WAKE) == Header(Kind.WAKE)
    port = Header.port(9, "ipc:///o", "ipc:///there", "m1")
    assert (port.kind, port.call_id, port.reply_to) == (Kind.PORT, 9, "ipc:///there")
    for h in (call, fwd, again, reply, nack, ctl, port):
        assert Header.decode(h.encode()) == h


def test_every_payload_type_is_in_the_table_and_every_kind_has_a_handler():
    assert set(PAYLOADS) == set(PAYLOAD_EXAMPLES)
    from monarch_kernel.runtime.process import Runtime

    assert set(Runtime.current().handlers) == set(Kind)


@pytest.mark.parametrize("kind, raw", [
    (Kind.CALL, [[["gpus", "4"]], [0], False]), (Kind.CALL, [[], [0, "1"], False]), (Kind.CALL, [[], [0]]),
    (Kind.SPAWN, [1]), (Kind.REPLY, ["a", "ipc:///not-tcp"]), (Kind.PRUNE, ["3"]),
    (Kind.DEATH, [3]), (Kind.REVIVE, ["m", "1"]), (Kind.INTERRUPT, ["a"]), (Kind.STOP, [1]),
    (Kind.MOVED, ["m", 1, "tcp://a:1", "tcp://b:2"]), (Kind.MOVED, ["m", 1, "ipc:///a", "tcp://b:2", "h"]),
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


def test_a_small_tensor_travels_inline_as_its_bytes_and_comes_back_whole():
    torch = pytest.importorskip("torch")
    import pickle

    cases = [torch.ones(4, 4), torch.tensor(3.5), torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
             torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64), torch.tensor([True, False]),
             torch.arange(64).reshape(8, 8).t()[1:3],  # a strided view: its values, not its storage
             torch.ones(3, requires_grad=True)]
    for t in cases:
        frames = dumps((t,))
        assert len(frames) == 1 and b"torch._utils" not in bytes(frames[0])  # not torch's own reduction
        back = Part(0, 0, frames).load()[0]
        assert back.dtype == t.dtype and back.shape == t.shape and back.requires_grad == t.requires_grad
        assert torch.equal(back.detach(), t.detach())
    back = Part(0, 0, dumps(torch.zeros(2, 2))).load()
    back.add_(1)  # its own writable memory
    assert back.sum().item() == 4
    big = torch.ones(1024, 1024)
    assert sum(memoryview(f).nbytes for f in dumps(big[3:5])) < 9000  # a view's values, not its 4 MiB storage
    assert len(dumps(big[0, :8])[0]) < 300
    conj = torch.tensor([1 + 2j]).conj()
    assert torch.equal(pickle.loads(bytes(dumps(conj)[0])), conj.resolve_conj())


def _signed(signer, body=None):
    body = body if body is not None else dumps(("x", 1))
    h = Header(Kind.CALL, 1, "ipc:///o", "ipc:///o", "m", "a", "f", [0])
    h.parts = [[0, 0, len(body) - 1]]
    return signer.sign(h, body)


HALF_IMPORTED = """
import sys, types
sys.modules["torch"] = types.ModuleType("torch")  # what another thread's `import torch` shows meanwhile
sys.modules["numpy"] = types.ModuleType("numpy")
from monarch_kernel.data.memory import as_memory
from monarch_kernel.runtime.wire.envelope import Part
from monarch_kernel.runtime.wire.serialize import dumps
value = {"x": [1, 2.5, "three", bytearray(8192)], "f": lambda: 1}  # the lambda: cloudpickle's path too
back = Part(0, 0, dumps(value)).load()
assert back["x"] == value["x"] and back["f"]() == 1
assert as_memory(bytearray(16), writable=True, what="dst").nbytes == 16
print("ok")
"""


def test_results_pickle_while_another_thread_is_still_importing_torch():
    # Found by the chaos run: a rank's echo answered while its DDP endpoint was importing torch
    # failed with "partially initialized module 'torch' has no attribute 'Tensor'".
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", HALF_IMPORTED], capture_output=True, text=True, timeout=30)
    assert r.stdout.strip() == "ok", r.stderr[-2000:]


def test_sign_verify_and_every_rejection():
    key = secrets.token_bytes(32)
    s = Signer(key)
    frames = _signed(s)
    header, body = s.verify(frames)
    assert header.method == "f" and Part(0, 0, body).load() == ("x", 1)
    _every_rejection(key, frames, lambda frames, signer=s: signer.verify(frames), lambda **kw: Signer(key, **kw))


def _every_rejection(key, frames, check, signer):
    """The drop reason of each kind of bad message, checked with ``check(frames, signer)``;
    ``signer(**kw)`` makes a signer of the path under test."""
    def reason(frames, *more):
        with pytest.raises(Dropped) as info:
            check(frames, *more)
        return info.value.reason

    assert reason([b"garbage"]) == "unsigned"
    assert reason([b"short-mac", *frames[1:]]) == "unsigned"
    assert reason(_signed(Signer(secrets.token_bytes(32)))) == "forged"
    tampered = list(frames)
    tampered[2] = dumps(("y", 1))[0]
    assert reason(tampered) == "forged"
    assert reason(frames[:-1]) == "truncated"
    assert reason([frames[0], b"\xc1\xc1", *frames[2:]]) == "malformed"
    assert reason(frames, signer(max_frame=4)) == "oversized"
    return reason


def test_the_signer_refuses_before_sending_a_frame_the_receiver_would_drop():
    """The frame limit is the signer's: what it would drop as oversized on receipt, it refuses
    to send, naming what needed the frame and the setting to raise."""
    s = Signer(secrets.token_bytes(32), max_frame=4)
    fits, over = [b"1234", memoryview(b"abcd")], [b"12", memoryview(b"abcde")]
    assert not s.oversized(fits) and s.oversized(over)
    s.check_size(fits, "the arguments of train")
    with pytest.raises(ValueError) as e:
        s.check_size(over, "the arguments of train")
    assert str(e.value) == ("the arguments of train need a 5-byte frame, over the 4-byte limit the receiver would "
                            "drop; raise MONARCH_KERNEL_MAX_FRAME (bytes) before spawning")
    with pytest.raises(Dropped, match="oversized"):
        s.verify(_signed(s, over))


def test_bulk_buffers_are_bound_by_length():
    s = Signer(secrets.token_bytes(32))
    big = np.zeros(BULK, dtype=np.uint8)
    frames = _signed(s, dumps(big))
    s.verify(frames)
    longer = list(frames)
    longer[3] = bytes(BULK + 1)
    with pytest.raises(Dropped, match="forged"):
        s.verify(longer)


@pytest.mark.parametrize("body", [[b"small"], [b"a", b"b" * 5000, memoryview(b"c" * 70000), b"tail"], []])
def test_packed_frames_round_trip_to_the_signed_layout(body):
    """Small parts ride in the first frame with the MAC and header; large ones follow as
    frames of their own; unpacking gives back exactly what was signed."""
    from monarch_kernel.runtime.wire.framing import INLINE_MAX, pack, unpack

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
    from monarch_kernel.runtime.wire.framing import pack, unpack

    s = Signer(secrets.token_bytes(32))
    first = pack(_signed(s))[0]
    for cut, reason in ((first[:-1], "truncated"), (first + b"x", "malformed"), (first[:34], "malformed")):
        with pytest.raises(Dropped) as info:
            unpack([cut])
        assert info.value.reason == reason


# ---------------------------------------------------------------- seal/open, both paths
# ``Signer.seal``/``open`` run in C (native/wire.c) where it is built, else in Python; the
# two speak one wire format.  Every test below runs on each path, and across them.

def _native_or_skip():
    from monarch_kernel.runtime.wire import native

    ok, why = native.is_available()
    if not ok:
        pytest.skip(why)


@pytest.fixture(params=["python", "native"])
def wire(request):
    if request.param == "native":
        _native_or_skip()
    return request.param == "native"


def _headers():
    yield Header(Kind.CALL, 7, "ipc:///a", "ipc:///b", "m1", "act-1", "step", [3, 4, 5], 4, Mode.GATHER,
                 False, 1, [[-1, Status.OK, 0]], PAYLOAD_EXAMPLES[Kind.CALL])
    yield Header(Kind.REPLY, 2**40, "ipc:///a", "ipc:///b", "m1", ranks=[0], parts=[[0, 0, 1], [1, 1, 0]],
                 payload=PAYLOAD_EXAMPLES[Kind.REPLY])
    yield Header(Kind.WAKE)
    yield Header(Kind.CALL, -5, "é" * 40, "x" * 300, ranks=list(range(100)), parts=[[-1, 0, 2]])


@pytest.mark.parametrize("sealer, opener", [(False, False), (True, True), (True, False), (False, True)],
                         ids=["python", "native", "native-to-python", "python-to-native"])
def test_seal_open_round_trip(sealer, opener):
    if sealer or opener:
        _native_or_skip()
    key = secrets.token_bytes(32)
    out, into = Signer(key, wire=sealer), Signer(key, wire=opener)
    assert (out.native, into.native) == (sealer, opener)
    for h in _headers():
        n = sum(1 + p[2] for p in h.parts)
        for sizes in ([10] * n, [70000] * n, [5, BULK + 1, 100][:n] + [1] * max(0, n - 3), [0] * n):
            body = [secrets.token_bytes(k) for k in sizes[:n]]
            frames = out.seal(h, body)
            back, got = into.open(frames)
            assert back == h and type(back.payload) is type(h.payload)
            assert [bytes(f) for f in got] == body
            bad = [bytearray(bytes(f)) for f in frames]
            bad[0][-1] ^= 1  # the last byte of the first frame: a part, or the header
            with pytest.raises(Dropped):
                into.open([bytes(f) for f in bad])
        # The logical layout (what tools and tests write by hand) opens the same way.
        body = [b"p"] * n
        assert into.open(out.sign(h, body))[0] == h


def test_open_drops_what_verify_drops(wire):
    key = secrets.token_bytes(32)
    s = Signer(key, wire=wire)
    frames = _signed(s)
    assert s.open(frames)[0].method == "f"
    reason = _every_rejection(key, frames, lambda frames, signer=s: signer.open(frames),
                              lambda **kw: Signer(key, wire=wire, **kw))
    first = s.seal(Header(Kind.CALL, 1, "o", "o", "m", "a", "f", [0], parts=[[0, 0, 0]]), [b"x"])[0]
    assert reason([first[:-1]]) == "truncated"
    assert reason([first + b"x"]) == "malformed"
    assert reason([first[:34]]) == "malformed"
    other = Signer(secrets.token_bytes(32), wire=wire)
    s.add_key(["theirs"], other_key := secrets.token_bytes(32))
    theirs = Signer(other_key, wire=wire)
    h = Header(Kind.WAKE, mesh="theirs")
    assert s.open(theirs.seal(h, []))[0].mesh == "theirs"  # a trusted mesh of another job's key
    assert reason(other.seal(h, [])) == "forged"


def test_both_paths_drop_the_same_corruptions_for_the_same_reason():
    _native_or_skip()
    import random

    key = secrets.token_bytes(32)
    native, python = Signer(key, wire=True), Signer(key, wire=False)
    h = Header(Kind.CALL, 1, "ipc:///o", "ipc:///o", "m", "a", "f", [0], parts=[[-1, 0, 1]],
               payload=PAYLOAD_EXAMPLES[Kind.CALL])
    good = python.seal(h, [pickle.dumps((1, 2)), b"abc"])
    rng = random.Random(7)

    def outcome(signer, frames):
        try:
            signer.open(frames)
            return "ok"
        except Dropped as d:
            return d.reason

    for _ in range(3000):
        first = bytearray(good[0])
        op = rng.random()
        extra = []
        if op < 0.5:
            for _ in range(rng.randint(1, 3)):
                first[rng.randrange(len(first))] = rng.randrange(256)
        elif op < 0.8:
            del first[rng.randrange(len(first)):]
        else:
            extra = [secrets.token_bytes(rng.randint(0, 40))]
        frames = [bytes(first), *extra]
        assert outcome(native, frames) == outcome(python, frames), frames


def test_the_setting_turns_the_c_path_off():
    with configured(native_wire=False):
        assert not Signer(secrets.token_bytes(32)).native
    from monarch_kernel.runtime.wire import native

    with configured(native_wire=True):
        assert Signer(secrets.token_bytes(32)).native == native.is_available()[0]


class WireProbe(Actor):
    @endpoint
    def native(self) -> bool:
        from monarch_kernel.runtime.process import Runtime

        return Runtime.current().signer.native

    @endpoint
    def echo(self, x):
        return x


@pytest.mark.timeout(120)
def test_ranks_on_the_pure_python_path_and_a_native_controller_understand_each_other():
    """Real ranks forced onto the pure-Python path (MONARCH_KERNEL_NATIVE_WIRE=0) answer a
    controller on the C path: small calls, a tree call, and a large out-of-band frame."""
    _native_or_skip()
    from monarch_kernel.runtime.process import Runtime

    assert Runtime.current().signer.native
    dropped = dict(Runtime.current().stats()["dropped"])
    with this_host().spawn_procs(per_host={"r": 3}, env={"MONARCH_KERNEL_NATIVE_WIRE": "0"}) as procs:
        m = procs.spawn("wireprobe", WireProbe)
        assert list(m.native.call().get(timeout=60).values()) == [False, False, False]
        big = np.arange(40_000)  # 320 KB: a frame of its own after the first
        for got in m.echo.call(big).get(timeout=30).values():
            assert np.array_equal(got, big)
        assert m.slice(r=1).echo.call_one("x" * 10).get(timeout=30) == "x" * 10
        assert Runtime.current().stats()["dropped"] == dropped  # nothing the controller could not read
