"""Bad input: forged and malformed messages on every inbox, pickles that must never be
loaded, values that do not pickle, and API misuse.  Every rejection is checked by its exact
counter or message, and the mesh must keep answering afterwards."""

from __future__ import annotations

import collections
import os
import pickle
import re
import secrets
import socket
import threading
import time

import pytest
from support.actors import BadInit, Echo, inject, wait_for

from monarch_kernel import ActorError, MeshStopped, ProcessDied, this_host
from monarch_kernel.runtime.net.inbox import actor_address
from monarch_kernel.runtime.process import Runtime
from monarch_kernel.runtime.wire.auth import Signer
from monarch_kernel.runtime.wire.envelope import Header, Kind

SMALL_FRAME = 1_000_000
REASONS = ("unsigned", "forged", "truncated", "oversized", "malformed", "curve")


# ---------------------------------------------------------------- building bad messages


def _call_header(mesh_id: str, actor: str, rank: int, kind: int = Kind.CALL, nbufs: int = 0) -> Header:
    origin = Runtime.current().address
    h = Header(kind, 10**9 + secrets.randbelow(10**6), origin, origin, mesh_id, actor, "echo", [rank])
    h.parts = [[-1, 0, nbufs]]
    return h


def bad_messages(mesh_id: str, actor: str, rank: int, *, big_frame: bool) -> list[tuple[str, list, str]]:
    """``(what, frames, expected drop reason)`` for each kind of bad message."""
    key = Runtime.current().key
    real, other = Signer(key), Signer(secrets.token_bytes(32))
    args = pickle.dumps(((1,), {}))
    msgs = []

    msgs.append(("garbage single frame", [b"this is not a message"], "unsigned"))
    rnd = [os.urandom(n) for n in (7, 300, 1, 64, 4096)]
    msgs.append(("random frames, no 32-byte mac", rnd, "unsigned"))
    # 0xc1 is the one byte msgpack never uses: the header cannot parse.
    msgs.append(("random frames, unparsable header",
                 [os.urandom(32), b"\xc1" + os.urandom(99), os.urandom(50)], "malformed"))
    msgs.append(("wrong key", other.sign(_call_header(mesh_id, actor, rank), [args]), "forged"))
    zero = real.sign(_call_header(mesh_id, actor, rank), [args])
    zero[0] = b"\0" * 32
    msgs.append(("zero mac", zero, "forged"))
    tampered = real.sign(_call_header(mesh_id, actor, rank), [args])
    body = bytearray(tampered[2])
    body[-2] ^= 0x01
    tampered[2] = bytes(body)
    msgs.append(("real key, body changed after signing", tampered, "forged"))
    cut = real.sign(_call_header(mesh_id, actor, rank, nbufs=1), [args, b"x" * 100])
    msgs.append(("real key, last frame removed", cut[:-1], "truncated"))
    msgs.append(("header over 64 KiB", [os.urandom(32), b"\x90" * (70 * 1024), args], "oversized"))
    many = real.sign(_call_header(mesh_id, actor, rank), [args])
    msgs.append(("more than 65536 frames", many + [b""] * (1 << 16), "oversized"))
    if big_frame:
        big = other.sign(_call_header(mesh_id, actor, rank, nbufs=1), [args, b"\0" * (2 * SMALL_FRAME)])
        msgs.append(("2 MB frame over MONARCH_KERNEL_MAX_FRAME", big, "oversized"))
    return msgs


def expected_counts(msgs) -> dict:
    c = collections.Counter(reason for _, _, reason in msgs)
    return {r: c.get(r, 0) for r in REASONS}


def delta(after: dict, before: dict) -> dict:
    return {r: after["dropped"][r] - before["dropped"][r] for r in REASONS}


def raw_unix_garbage(address: str) -> None:
    """Bytes that are not even ZMTP, written straight onto the inbox's ipc socket."""
    path = address.removeprefix("ipc://")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        s.sendall(os.urandom(4096))
    finally:
        s.close()


def rank_stats(m) -> list[dict]:
    return list(m.stats.call().get(timeout=30).values())


# ---------------------------------------------------------------- forged and malformed frames


@pytest.mark.timeout(90)
def test_bad_frames_on_every_inbox_are_counted_and_dropped():
    rt = Runtime.current()
    with this_host().spawn_procs(per_host={"gpus": 4}, env={"MONARCH_KERNEL_MAX_FRAME": str(SMALL_FRAME)}) as procs:
        m = procs.spawn("echo", Echo)
        ref = procs._ref
        assert list(m.echo.call(1).get(timeout=30).values()) == [1, 1, 1, 1]
        ranks_before = rank_stats(m)
        ctl_before = rt.stats()

        # Every rank listens on its main inbox and on the actor's own inbox.
        per_rank_expected = []
        for r in range(4):
            msgs = bad_messages(ref.id, m._actor_id, r, big_frame=True)
            for addr in (ref.addresses[r], actor_address(ref.addresses[r], m._actor_id)):
                inject(addr, *[frames for _, frames, _ in msgs])
            per_rank_expected.append({k: 2 * v for k, v in expected_counts(msgs).items()})

        # The controller listens on its main inbox and on this thread's reply inbox.
        ctl_msgs = bad_messages(rt.self_mesh.id, "nobody", 0, big_frame=False)
        for addr in (rt.address, rt.caller.reply_inboxes.mine().address):
            inject(addr, *[frames for _, frames, _ in ctl_msgs])
        ctl_expected = {k: 2 * v for k, v in expected_counts(ctl_msgs).items()}

        def settled():
            # Calling reads this thread's reply inbox, so its drops get counted too.
            now = rank_stats(m)
            ok = all(delta(now[r], ranks_before[r]) == per_rank_expected[r] for r in range(4))
            return ok and delta(rt.stats(), ctl_before) == ctl_expected

        wait_for(settled, timeout=30, interval=0.2)
        ranks_after = rank_stats(m)
        for r in range(4):
            assert delta(ranks_after[r], ranks_before[r]) == per_rank_expected[r], f"rank {r}"
        assert delta(rt.stats(), ctl_before) == ctl_expected
        assert {k: getattr(rt.drops, k) for k in REASONS} == rt.stats()["dropped"]

        # Still answering, on every rank and through the controller.
        assert list(m.echo.call("after").get(timeout=30).values()) == ["after"] * 4
        assert m.slice(gpus=3).echo.call_one(7).get(timeout=30) == 7
        m2 = procs.spawn("echo2", Echo)
        assert list(m2.echo.call(2).get(timeout=30).values()) == [2] * 4

        # Bytes that are not even ZMTP, straight onto each ipc socket.  libzmq may read
        # them as legacy ZMTP/1.0 frames and deliver any number of junk messages; none
        # can pass as signed.
        addresses = [rt.address, rt.caller.reply_inboxes.mine().address]
        for r in range(4):
            addresses += [ref.addresses[r], actor_address(ref.addresses[r], m._actor_id)]
        forged_before = [s["dropped"]["forged"] for s in rank_stats(m)] + [rt.drops.forged]
        for addr in addresses:
            raw_unix_garbage(addr)
        assert list(m.echo.call("raw").get(timeout=30).values()) == ["raw"] * 4
        assert list(m2.echo.call("raw").get(timeout=30).values()) == ["raw"] * 4
        assert [s["dropped"]["forged"] for s in rank_stats(m)] + [rt.drops.forged] == forged_before


@pytest.mark.timeout(60)
def test_two_megabyte_argument_passes_without_the_limit():
    """The 2 MB frame dropped above is dropped because of MONARCH_KERNEL_MAX_FRAME: the
    same size is a normal argument for ranks spawned without the limit."""
    big = b"\1" * (2 * SMALL_FRAME)
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        m = procs.spawn("echo", Echo)
        assert [len(v) for v in m.echo.call(big).get(timeout=30).values()] == [len(big)] * 2


# ---------------------------------------------------------------- pickles that must not be loaded


class _CreatesFile:
    """Unpickling this opens ``path`` for writing, which creates the file."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _payload(path: str) -> bytes:
    return pickle.dumps(_CreatesFile(path), protocol=5)


@pytest.mark.timeout(60)
def test_forged_pickle_is_never_loaded(tmp_path):
    # The payload really does create its file when loaded (so the test can fail).
    control = tmp_path / "control"
    pickle.loads(_payload(str(control))).close()
    assert control.exists()

    rt = Runtime.current()
    forger = Signer(secrets.token_bytes(32))
    real = Signer(rt.key)
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        m = procs.spawn("echo", Echo)
        ref = procs._ref
        before = rank_stats(m)
        ctl_before = rt.stats()
        targets = []  # (address, mesh id, actor, rank)
        for r in range(2):
            targets.append((ref.addresses[r], ref.id, m._actor_id, r))
            targets.append((actor_address(ref.addresses[r], m._actor_id), ref.id, m._actor_id, r))
        targets.append((rt.address, rt.self_mesh.id, "nobody", 0))
        targets.append((rt.caller.reply_inboxes.mine().address, rt.self_mesh.id, "nobody", 0))

        paths = []
        for i, (addr, mesh_id, actor, rank) in enumerate(targets):
            msgs = []
            for kind in (Kind.CALL, Kind.SPAWN, Kind.REPLY, Kind.DEATH, Kind.FAILURE):
                path = tmp_path / f"pwned-{i}-{Kind(kind).name}"
                paths.append(path)
                h = _call_header(mesh_id, actor, rank, kind=kind)
                msgs.append(forger.sign(h, [_payload(str(path))]))
            # Signed with the real key but cut short: still never unpickled.
            path = tmp_path / f"pwned-{i}-truncated"
            paths.append(path)
            h = _call_header(mesh_id, actor, rank, nbufs=1)
            msgs.append(real.sign(h, [_payload(str(path)), b"buffer"])[:-1])
            inject(addr, *msgs)

        def counted():
            now = rank_stats(m)
            ranks_ok = all(delta(now[r], before[r]) == {**dict.fromkeys(REASONS, 0), "forged": 10, "truncated": 2}
                           for r in range(2))
            return ranks_ok and delta(rt.stats(), ctl_before) == {**dict.fromkeys(REASONS, 0),
                                                                    "forged": 10, "truncated": 2}

        wait_for(counted, timeout=30, interval=0.2)
        after = rank_stats(m)
        for r in range(2):
            assert delta(after[r], before[r]) == {**dict.fromkeys(REASONS, 0), "forged": 10, "truncated": 2}
        assert delta(rt.stats(), ctl_before) == {**dict.fromkeys(REASONS, 0), "forged": 10, "truncated": 2}
        assert [p.name for p in paths if p.exists()] == []
        assert list(m.echo.call(3).get(timeout=30).values()) == [3, 3]
    assert [p.name for p in paths if p.exists()] == []


# ---------------------------------------------------------------- values that do not pickle


@pytest.mark.timeout(60)
def test_unpicklable_argument_is_a_clear_type_error():
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        m = procs.spawn("echo", Echo)
        expected = ("an argument to Echo.echo cannot be sent to the ranks: "
                    "TypeError: cannot pickle '_thread.lock' object (while pickling a _thread.lock)")
        with pytest.raises(TypeError, match=f"^{re.escape(expected)}$"):
            m.echo.call(threading.Lock())
        with pytest.raises(TypeError, match=re.escape("cannot pickle '_thread.lock' object")):
            m.slice(gpus=0).echo.call_one(x=[1, threading.Lock()])
        with pytest.raises(TypeError, match=re.escape(
                "Echo(...) cannot be sent to the ranks: TypeError: cannot pickle '_thread.lock' object")):
            procs.spawn("bad", Echo, threading.Lock())
        # Nothing was sent, nothing is stuck: the mesh keeps working.
        assert list(m.echo.call(5).get(timeout=30).values()) == [5, 5]

        def settled():
            # The spawn's answers go to the IO thread, the echo's to this thread: the spawn's
            # call can still be filed for a moment after the echo returned.
            return all(c.mesh.id != procs._ref.id for c in list(Runtime.current().caller.calls.values()))

        deadline = time.monotonic() + 10
        while not settled() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert settled(), "a call to the mesh stayed pending"


@pytest.mark.timeout(60)
def test_unpicklable_result_is_an_actor_error_naming_the_type():
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        m = procs.spawn("echo", Echo)
        with pytest.raises(ActorError) as info:
            m.make_lock.call().get(timeout=30)
        err = info.value
        assert re.search(r"the result of echo-\w+\.make_lock on rank 0 could not be pickled: TypeError: "
                         r"cannot pickle '_thread\.lock' object \(while pickling a _thread\.lock\)", str(err)), str(err)
        assert isinstance(err.__cause__, TypeError)
        assert [type(v) for v in err.results.values()] == [ActorError, ActorError]
        assert "rank 1 could not be pickled" in str(err.results[1])
        assert list(m.echo.call(6).get(timeout=30).values()) == [6, 6]
        assert m.slice(gpus=1).echo.call_one(7).get(timeout=30) == 7

        # An exception that does not pickle still arrives, as text, without a __cause__.
        with pytest.raises(ActorError) as info:
            m.slice(gpus=0).raise_unpicklable.call_one().get(timeout=30)
        err = info.value
        assert err.__cause__ is None
        assert "raised on rank 0" in str(err) and "LockedError: holds a lock" in str(err)
        assert 'raise LockedError("holds a lock")' in err.remote_traceback
        assert m.slice(gpus=0).echo.call_one(8).get(timeout=30) == 8

        # One whose report itself fails (its str() raises) is still answered, not left pending.
        with pytest.raises(ActorError) as info:
            m.slice(gpus=1).raise_unprintable.call_one().get(timeout=30)
        assert "UnprintableError" in str(info.value) and "no words for it" in str(info.value), str(info.value)
        assert m.slice(gpus=1).echo.call_one(9).get(timeout=30) == 9


# ---------------------------------------------------------------- misuse of the API


@pytest.mark.timeout(60)
def test_call_to_stopped_mesh_raises_mesh_stopped():
    procs = this_host().spawn_procs(per_host={"gpus": 2}, name="stopme")
    try:
        m = procs.spawn("echo", Echo)
        one = m.slice(gpus=1)
        copy = pickle.loads(pickle.dumps(m))  # a reference without the owner's ProcMesh
        sub = procs.slice(gpus=0)
        inflight = m.sleep.call(30)
    finally:
        procs.stop().get(timeout=20)
    with pytest.raises(MeshStopped, match=re.escape("mesh 'stopme' was stopped; Echo 'echo' cannot be called. "
                                                    "Spawn a new mesh.")):
        m.echo.call(1)
    with pytest.raises(MeshStopped, match="mesh 'stopme' was stopped"):
        one.echo.call_one(1)
    with pytest.raises(MeshStopped, match="mesh 'stopme' was stopped"):
        copy.echo.call(1)
    with pytest.raises(MeshStopped, match=re.escape("mesh 'stopme' was stopped; spawn a new mesh to host 'again'")):
        procs.spawn("again", Echo)
    # A slice of the procs taken before the stop cannot host new actors either.
    with pytest.raises(MeshStopped, match="mesh 'stopme' was stopped"):
        sub.spawn("again", Echo)
    # A call that was running when the mesh stopped ends with MeshStopped, not a hang.
    with pytest.raises(MeshStopped, match=re.escape("mesh 'stopme' was stopped; rank 0 cannot answer Echo.sleep")):
        inflight.get(timeout=20)


@pytest.mark.timeout(60)
def test_call_one_on_many_ranks_says_to_slice():
    with this_host().spawn_procs(per_host={"gpus": 4}) as procs:
        m = procs.spawn("echo", Echo)
        with pytest.raises(ValueError, match=re.escape(
                "call_one needs a mesh of exactly one rank; this one has 4 (gpus=4). Slice it first, "
                "e.g. mesh.slice(gpus=0).echo.call_one(...)")):
            m.echo.call_one(1)
        with pytest.raises(ValueError, match="this one has 2 .*Slice it first"):
            m.slice(gpus=slice(0, 2)).echo.call_one(1)
        assert m.slice(gpus=slice(1, 2)).echo.call_one(1).get(timeout=30) == 1


@pytest.mark.timeout(60)
def test_bad_slices():
    with this_host().spawn_procs(per_host={"hosts": 2, "gpus": 2}) as procs:
        m = procs.spawn("echo", Echo)
        unknown = ("mesh has no dimension 'gpu'; its dimensions are hosts=2, gpus=2 "
                   "(slice with one of: hosts, gpus)")
        for mesh in (m, procs):
            with pytest.raises(ValueError, match=f"^{re.escape(unknown)}$"):
                mesh.slice(gpu=0)
            with pytest.raises(IndexError,
                               match=re.escape("gpus=2 is out of range; dimension 'gpus' has size 2 (0..1)")):
                mesh.slice(gpus=2)
            with pytest.raises(IndexError,
                               match=re.escape("hosts=-3 is out of range; dimension 'hosts' has size 2 (0..1)")):
                mesh.slice(hosts=-3)
            with pytest.raises(IndexError,
                               match=re.escape("gpus=range(2, 2) selects nothing; dimension 'gpus' has size 2")):
                mesh.slice(gpus=range(2, 2))
        with pytest.raises(ValueError, match=re.escape("mesh has no dimension 'hosts'; its dimensions are gpus=2")):
            m.slice(hosts=0).slice(hosts=0)
        # The bad slices changed nothing.
        assert m.slice(hosts=1, gpus=1).echo.call_one("ok").get(timeout=30) == "ok"


@pytest.mark.timeout(60)
def test_bad_spawn_arguments():
    for bad in ({"gpus": 0}, {"gpus": -1}, {"gpus": True}, {"gpus": "4"}):
        with pytest.raises(ValueError, match=re.escape(
                f"per_host={{'gpus': {bad['gpus']!r}}}: sizes must be positive ints, e.g. per_host={{'gpus': 4}}")):
            this_host().spawn_procs(per_host=bad)
    with this_host().spawn_procs(per_host={"gpus": 1}) as procs:
        with pytest.raises(TypeError, match="^spawn takes an Actor class, not function$"):
            procs.spawn("f", lambda: None)
        assert procs.spawn("echo", Echo).echo.call_one(1).get(timeout=30) == 1


@pytest.mark.timeout(60)
def test_rank_that_cannot_start_fails_spawn_promptly():
    """A bad setting kills the ranks at start-up: spawn_procs raises the death, with the
    rank's stderr, instead of waiting out the spawn timeout."""
    with pytest.raises(ProcessDied) as info:
        this_host().spawn_procs(per_host={"gpus": 2}, name="badenv", env={"MONARCH_KERNEL_MAX_FRAME": "lots"},
                                timeout=45)
    err = info.value
    assert err.exitcode == 1 and err.rank in (0, 1)
    assert f"rank {err.rank} of mesh 'badenv'" in str(err) and "exited with code 1" in str(err)
    assert err.stderr_tail[-1] == "ValueError: invalid literal for int() with base 10: 'lots'"


# ---------------------------------------------------------------- errors raised on ranks


@pytest.mark.timeout(60)
def test_init_raising_fails_spawn_with_remote_traceback(monkeypatch):
    # As in Monarch: spawn() returns at once; the failed __init__ is a supervision event
    # for the spawner, and calls to the actor fail with __init__'s own traceback.
    import monarch_kernel

    events = []
    monkeypatch.setattr(monarch_kernel, "unhandled_fault_hook", events.append)
    with this_host().spawn_procs(per_host={"gpus": 2}) as procs:
        bad = procs.spawn("bad", BadInit, "no GPU")
        with pytest.raises(ActorError) as info:
            bad.initialized().get(timeout=30)
        with pytest.raises(ActorError) as later:
            bad.slice(gpus=0).echo.call_one(1).get(timeout=30)
        assert "KeyError: 'cannot start actor: no GPU'" in str(later.value) and later.value.method == "__init__"
        wait_for(lambda: len(events) >= 2, timeout=10)
        # One event per rank whose __init__ raised, as in Monarch.
        assert sorted(e.rank for e in events) == [0, 1]
        assert all("cannot start actor: no GPU" in str(e) for e in events)
        err = info.value
        assert isinstance(err.__cause__, KeyError)
        assert err.__cause__.args == ("cannot start actor: no GPU",)
        text = str(err)
        assert "raised on rank 0" in text and "KeyError: 'cannot start actor: no GPU'" in text
        assert re.match(r"Actor call bad\.__init__ failed\.\n It raised on rank 0 \(pid \d+ on ", text)
        assert "Traceback of where the remote call failed (most recent call last):" in text
        assert 'raise KeyError(f"cannot start actor: {reason}")  # the line the test looks for' in text
        assert re.search(r'File ".*support/actors\.py", line \d+, in __init__', err.remote_traceback)
        assert err.method == "__init__" and err.rank == 0
        # The procs are fine: another actor spawns and answers.
        m = procs.spawn("echo", Echo)
        assert list(m.echo.call(1).get(timeout=30).values()) == [1, 1]


@pytest.mark.timeout(60)
def test_endpoint_raising_value_error():
    with this_host().spawn_procs(per_host={"gpus": 4}) as procs:
        m = procs.spawn("echo", Echo)
        with pytest.raises(ActorError) as info:
            m.fail_on.call(2, 5).get(timeout=30)
        err = info.value
        assert isinstance(err.__cause__, ValueError)
        assert str(err.__cause__) == "bad value 5 on rank 2"
        assert err.rank == 2 and err.method == "fail_on"
        assert "raised on rank 2" in str(err) and "ValueError: bad value 5 on rank 2" in str(err)
        # Monarch's leading line and traceback heading, then where it happened.
        assert re.match(r"Actor call echo\.fail_on failed\.\n It raised on rank 2 \(pid \d+ on ", str(err))
        assert " Traceback of where the remote call failed (most recent call last):\n" in str(err)
        assert 'raise ValueError(f"bad value {value!r} on rank {bad_rank}")' in err.remote_traceback
        assert "in fail_on" in err.remote_traceback
        results = err.results
        assert [results[i] for i in (0, 1, 3)] == [50, 50, 50]
        assert results[2] is err
        assert results.extent == {"gpus": 4}
        # The remote traceback does not also carry the runtime's own frames.
        assert "_run_sync" not in err.remote_traceback
        assert list(m.echo.call(1).get(timeout=30).values()) == [1] * 4
