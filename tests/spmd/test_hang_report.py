"""Which ranks a hang report blames, from the flight recorder's snapshots (no processes): the
silent ones and those behind that wait in no collective, not a rank behind in one collective
but blocked inside an older one; and HangError's words, pickled as it travels."""

from __future__ import annotations

import os
import pickle

from monarch_kernel import HangError
from monarch_kernel.observe.stack_report import StackReport, from_json
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


def test_a_rank_caught_between_two_collectives_on_its_way_into_the_next_is_not_blamed():
    # 3 ranks in a ring: rank 1 stopped (silent) inside #7; rank 0 got its part and went on into #8;
    # rank 2 finished #7 too, and the snapshot caught it calling #8 (its stack in torch.distributed)
    # before the recorder saw it enter: it waits on rank 1 as rank 0 does.  A rank behind and
    # elsewhere (rank 3, loading data) is still blamed.
    snaps = {0: _snap(8, 7), 2: _snap(7, 7), 3: _snap(7, 7)}
    report = build_report("procs", snaps, [1], 0)
    torch_dist = "/site-packages/torch/distributed/distributed_c10d.py".replace("/", os.sep)
    user = "/home/u/train.py".replace("/", os.sep)

    def stack(rank: int, *frames: tuple[str, str]) -> object:
        return from_json(rank, "h", "in-process", [{"thread_name": "MainThread", "frames": [
            {"name": name, "filename": filename, "line": 1} for name, filename in frames]}])

    stacks = StackReport("procs", [stack(0, ("all_reduce", torch_dist), ("step", user)),
                                   stack(2, ("all_reduce", torch_dist), ("step", user)),
                                   stack(3, ("next_batch", user), ("step", user))])
    assert report.holding_up() == [1, 2, 3]
    assert stuck_ranks([0, 1, 2, 3], stacks, report) == ([1, 3], "the flight recorder")
    assert stuck_ranks([0, 1, 2, 3], None, report) == ([1, 2, 3], "the flight recorder")  # no stacks: as before


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
