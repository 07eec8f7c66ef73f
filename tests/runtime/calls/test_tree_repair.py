"""The caller alone (with the real outbox over a fake transport): a multicast tree repaired
after a rank of it dies, and a subtree its forwarder never received sent again.  No processes,
no sockets: the messages each part sends are read off the fake transport."""

from __future__ import annotations

import pytest
from support.fake_net import Parts, death, mesh

from monarch_kernel.runtime.wire.envelope import Header, Kind, Mode, Part, Status
from monarch_kernel.runtime.wire.serialize import dumps

pytestmark = pytest.mark.timeout(30)

ARGS = dumps(((), {}))


def answer(rank_parts: Parts, call, ranks: list[int]):
    """What the root of a subtree sends back for ``ranks``: a real REPLY, sealed and opened."""
    h = call.header
    parts = [Part(r, Status.OK, dumps(r * 10)) for r in ranks]
    rank_parts.outbox.send_parts(h.reply_to, False, parts, h.origin, h.call_id, ranks[0], h.mesh, None)
    (reply,) = rank_parts.transport.take(Kind.REPLY)
    return reply


@pytest.fixture
def ctl():
    p = Parts(fanout=2)
    yield p
    p.close()


def test_a_tree_is_repaired_around_a_dead_forwarder_and_the_call_completes(ctl):
    ref = mesh(7)
    pending = ctl.caller.call(ref, "a", "f", list(range(7)), ARGS)
    calls = ctl.transport.take()
    # fanout 2: two subtrees, [0, 1, 2, 3] (0 forwards to [1, 2] and [3]) and [4, 5, 6]
    assert [(s.kind, s.header.ranks) for s in calls] == [(Kind.CALL, [0, 1, 2, 3]), (Kind.CALL, [4, 5, 6])]
    assert all(s.header.mode == Mode.GATHER and s.header.hop == 0 for s in calls)

    assert ctl.caller.rank_died(ref.id, 1, death(ref, 1), ref) == 1  # one call waited on it
    repairs = ctl.transport.take()
    by_kind = {(s.kind, s.address) for s in repairs}
    # its child's subtree answers the origin instead; its parent stops waiting for it
    assert (Kind.REDIRECT, ref.addresses[2]) in by_kind
    assert (Kind.PRUNE, ref.addresses[0]) in by_kind
    (prune,) = [s for s in repairs if s.kind == Kind.PRUNE]
    assert prune.header.payload.rank == 1 and prune.header.call_id == pending.header.call_id
    assert (Kind.WAKE, pending.inbox.address) in by_kind  # the waiting thread is nudged
    assert ref.addresses[1] in ctl.transport.forgotten
    assert pending.parts[1].status == Status.DIED and not pending.completion.done()

    # the survivors answer: 0 for itself and 3, 2 straight to the origin (redirected), 4 for 4-6
    rank = Parts(address=ref.addresses[0], member_of=(ref, 0))
    try:
        for ranks in ([0, 3], [2], [4, 5, 6]):
            ctl.deliver(answer(rank, pending, ranks), ctl.caller.on_reply)
    finally:
        rank.close()
    assert pending.completion.done()
    assert {r: p.status for r, p in pending.parts.items()} == {0: Status.OK, 1: Status.DIED, 2: Status.OK,
                                                              3: Status.OK, 4: Status.OK, 5: Status.OK, 6: Status.OK}
    assert pending.parts[5].load() == 50
    assert ctl.caller.calls == {}  # it left the table


def test_a_dead_tree_root_redirects_both_its_children_and_prunes_nobody(ctl):
    ref = mesh(7)
    ctl.caller.call(ref, "a", "f", list(range(7)), ARGS)
    ctl.transport.take()
    ctl.caller.rank_died(ref.id, 0, death(ref, 0), ref)
    repairs = ctl.transport.take()
    assert sorted(s.address for s in repairs if s.kind == Kind.REDIRECT) == [ref.addresses[1], ref.addresses[3]]
    assert [s for s in repairs if s.kind == Kind.PRUNE] == []


def test_a_subtree_its_forwarder_never_received_is_sent_again_once(ctl):
    ref = mesh(7)
    pending = ctl.caller.call(ref, "a", "f", list(range(7)), ARGS)
    (first, _second) = ctl.transport.take()
    # rank 0 could not forward to 1: it says so (Server._forward), and the caller resends [1, 2]
    rank = Parts(address=ref.addresses[0], member_of=(ref, 0))
    try:
        rank.outbox.send_or_report(first.header.origin, Header.not_received(first.header, 1), [], "test")
        (nr,) = rank.transport.take()
    finally:
        rank.close()
    ctl.deliver(nr, ctl.caller.on_not_received)
    ctl.deliver(nr, ctl.caller.on_not_received)  # told twice: sent again once
    again = ctl.transport.take()
    assert sorted(r for s in again for r in s.header.ranks) == [1, 2]  # its subtree, split again
    assert all(s.kind == Kind.CALL and s.header.resend and s.body == list(ARGS) for s in again)
    assert {s.header.call_id for s in again} == {pending.header.call_id}
