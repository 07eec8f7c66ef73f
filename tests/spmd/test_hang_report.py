"""Which ranks a hang report blames, from the flight recorder's snapshots (no processes): the
silent ones and those behind that wait in no collective, not a rank behind in one collective
but blocked inside an older one; and HangError's words, pickled as it travels."""

from __future__ import annotations

import pickle

from monarch_kernel import HangError
from monarch_kernel.spmd.controller.collectives import build_report
from monarch_kernel.spmd.controller.hang_report import HangReport, stuck_ranks


def _snap(enqueued: int, completed: int) -> dict:
    return {"recorder": "torch", "groups": {"default_pg": {"last_enqueued": enqueued, "last_completed": completed,
                                                           "entries": [{"seq": enqueued, "op": "all_reduce"}]}}}


def test_the_silent_rank_and_the_one_outside_every_collective_are_blamed():
    # ranks 0 and 2 wait inside #5; rank 1 did not answer; rank 3 finished #4 and is elsewhere;
    # rank 4 is behind too, but blocked inside #4: it waits, it is not the cause.
    snaps = {0: _snap(5, 4), 2: _snap(5, 4), 3: _snap(4, 4), 4: _snap(4, 3)}
    report = build_report("procs", snaps, [1], 0)
    assert report.holding_up() == [1, 3, 4]
    assert stuck_ranks([0, 1, 2, 3, 4], None, report) == ([1, 3], "the flight recorder")


def test_without_a_group_the_rank_whose_stack_differs_is_blamed_else_every_busy_one():
    assert stuck_ranks([0, 1], None, None) == ([0, 1], "every rank still running the call")


def test_hang_error_names_the_rank_where_it_is_and_what_was_done():
    r = HangReport("procs", 5.0, [0, 1, 2], [1], "the flight recorder", where={1: "cell [4], line 5: x()"},
                   path="/tmp/h.txt", actions=["Rank 1 interrupted"])
    err = r.error()
    assert str(err) == ("no progress on mesh 'procs' for 5 s: rank 1 holds the others up (the flight recorder): "
                        "rank 1 at cell [4], line 5: x(). Rank 1 interrupted. Full report: /tmp/h.txt")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, HangError) and (back.ranks, back.where, back.report) == ([1], err.where, "/tmp/h.txt")
