"""An actor's life on a rank, with the server and the actors' lives alone (the actor's
worker is a real thread; its inbox and the network are fakes): a stop while ``__init__``
still runs returns after the grace, the actor refuses every call from then on, and the
spawn still answers when ``__init__`` ends.  No processes, no sockets."""

from __future__ import annotations

import threading

import pytest
from support.fake_net import Parts, mesh

from monarch_kernel.runtime.calls.actor_lives import STOP_INIT_GRACE_S
from monarch_kernel.runtime.calls.actor_slots import STOP_METHOD
from monarch_kernel.runtime.wire.envelope import Kind, Status
from monarch_kernel.runtime.wire.serialize import dumps

pytestmark = pytest.mark.timeout(60)

GATE = threading.Event()  # what the actor's __init__ waits for


class SlowToStart:
    def __init__(self):
        GATE.wait(30)

    def ping(self):
        return "pong"


SlowToStart.ping.__monarch_endpoint__ = True  # type: ignore[attr-defined]  (what @endpoint marks)


@pytest.fixture
def node():
    ref = mesh(1)
    ctl, rank = Parts(), Parts(address=ref.addresses[0], member_of=(ref, 0))
    GATE.clear()
    yield ref, ctl, rank
    GATE.set()
    rank.close()
    ctl.close()


def serve(ctl: Parts, rank: Parts, kind: int | None = None):
    """Hand what the controller sent to the rank's server."""
    for sent in ctl.transport.take(kind):
        rank.deliver(sent, rank.server.on_call)


def replies(rank: Parts, ctl: Parts) -> int:
    """Hand the rank's answers to the controller's caller; how many there were."""
    got = rank.transport.take(Kind.REPLY)
    for sent in got:
        ctl.deliver(sent, ctl.caller.on_reply)
    return len(got)


def test_a_stop_during_init_returns_after_the_grace_and_the_actor_refuses_calls(node):
    ref, ctl, rank = node
    spawn = ctl.caller.call(ref, "a1", "", [0], dumps((SlowToStart, (), {})), kind=Kind.SPAWN)
    serve(ctl, rank)
    slot = rank.lives.actors["a1"]
    stop = ctl.caller.call(ref, "a1", STOP_METHOD, [0], dumps(((), {})))
    serve(ctl, rank)
    assert not slot.constructed.done()
    rank.io.until(lambda: replies(rank, ctl) > 0, timeout=STOP_INIT_GRACE_S + 10, what="the stop's answer")
    assert stop.completion.done() and stop.parts[0].status == Status.OK
    assert slot.halted and not slot.constructed.done()  # __init__ still runs
    assert "stopped it before its __init__ returned" in str(slot.failure.load())

    ping = ctl.caller.call(ref, "a1", "ping", [0], dumps(((), {})))
    serve(ctl, rank)
    assert replies(rank, ctl) == 1 and ping.parts[0].status == Status.RAISED
    assert "before its __init__ returned" in str(ping.parts[0].load())

    GATE.set()  # __init__ returns: the spawn is answered, and the actor stays stopped
    rank.io.until(lambda: replies(rank, ctl) > 0 or spawn.completion.done(), timeout=10, what="the spawn's answer")
    assert spawn.completion.done() and slot.constructed.done()
    assert rank.receiver.unwatched == [slot.inbox]


def test_a_stop_during_a_short_init_is_the_usual_stop_once_it_returns(node):
    ref, ctl, rank = node
    spawn = ctl.caller.call(ref, "a1", "", [0], dumps((SlowToStart, (), {})), kind=Kind.SPAWN)
    serve(ctl, rank)
    stop = ctl.caller.call(ref, "a1", STOP_METHOD, [0], dumps(((), {})))
    serve(ctl, rank)
    GATE.set()
    rank.io.until(lambda: replies(rank, ctl) == 0 and spawn.completion.done() and stop.completion.done(),
                  timeout=10, what="the spawn's and the stop's answers")
    slot = rank.lives.actors["a1"]
    assert stop.parts[0].status == Status.OK and slot.halted
    assert "ActorMesh.stop() stopped it. Spawn it again" in str(slot.failure.load())  # not "before __init__"
