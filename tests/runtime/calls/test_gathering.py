"""A rank's server and gathering alone, as a node of a call's tree: it forwards the call to
its children (hop 1, answers back to itself), merges their hop-1 answers with its own, and
sends the caller one answer; a pruned child is no longer waited for.  No processes, no sockets."""

from __future__ import annotations

import pytest
from support.fake_net import Parts, death, mesh

from monarch_kernel.runtime.wire.envelope import Kind, Part, Status
from monarch_kernel.runtime.wire.serialize import dumps

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def tree():
    """The controller (fanout 2) and rank 0 of a 7-rank mesh, the root of subtree [0, 1, 2, 3]."""
    ref = mesh(7)
    ctl, rank = Parts(fanout=2), Parts(address=ref.addresses[0], member_of=(ref, 0), fanout=2)
    yield ref, ctl, rank
    rank.close()
    ctl.close()


def child_answer(ref, fwd, ranks: list[int]):
    """What the child at ``ranks[0]`` sends its tree node (hop 1) for its subtree ``ranks``."""
    child = Parts(address=ref.addresses[ranks[0]], member_of=(ref, ranks[0]))
    try:
        h = fwd.header
        child.outbox.send_parts(h.reply_to, True, [Part(r, Status.OK, dumps(r)) for r in ranks], h.origin,
                                h.call_id, ranks[0], h.mesh, None)
        (reply,) = child.transport.take()
    finally:
        child.close()
    assert reply.header.hop == 1
    return reply


def test_a_node_merges_its_childrens_hop_1_answers_with_its_own_and_answers_once(tree):
    ref, ctl, rank = tree
    pending = ctl.caller.call(ref, "nobody", "f", list(range(7)), dumps(((), {})))
    call = ctl.transport.take()[0]
    assert call.header.ranks == [0, 1, 2, 3]
    rank.deliver(call, rank.server.on_call)  # no actor "nobody" here: rank 0's own part fails
    forwards = rank.transport.take()
    assert sorted((s.header.ranks, s.header.hop) for s in forwards) == [([1, 2], 1), ([3], 1)]
    assert {s.header.reply_to for s in forwards} == {rank.outbox.target(ref, 0, Kind.CALL, "nobody")}

    first, second = sorted(forwards, key=lambda s: s.header.ranks)
    rank.deliver(child_answer(ref, first, [1, 2]), rank.gathering.on_reply)
    assert rank.transport.take() == []  # child 3 has not answered yet
    rank.deliver(child_answer(ref, first, [1, 2]), rank.gathering.on_reply)  # a repeat changes nothing
    rank.deliver(child_answer(ref, second, [3]), rank.gathering.on_reply)
    (merged,) = rank.transport.take()
    assert merged.kind == Kind.REPLY and merged.header.hop == 0 and merged.address == call.header.origin
    ctl.deliver(merged, ctl.caller.on_reply)
    assert {r: p.status for r, p in pending.parts.items()} == {0: Status.RAISED, 1: Status.OK, 2: Status.OK,
                                                              3: Status.OK}
    assert "no actor 'nobody' on rank 0" in str(pending.parts[0].load())
    assert pending.parts[2].load() == 2


def test_a_pruned_child_is_no_longer_waited_for(tree):
    ref, ctl, rank = tree
    ctl.caller.call(ref, "nobody", "f", list(range(7)), dumps(((), {})))
    call = ctl.transport.take()[0]
    rank.deliver(call, rank.server.on_call)
    first, _second = sorted(rank.transport.take(), key=lambda s: s.header.ranks)
    ctl.caller.rank_died(ref.id, 3, death(ref, 3), ref)
    (prune,) = ctl.transport.take(Kind.PRUNE)
    rank.deliver(prune, rank.gathering.on_prune)
    assert rank.transport.take() == []
    rank.deliver(child_answer(ref, first, [1, 2]), rank.gathering.on_reply)
    (merged,) = rank.transport.take()
    assert sorted(p[0] for p in merged.header.parts) == [0, 1, 2]
