"""What the user types to ranks stopped in pdb: the ``(mesh pdb)`` prompt (``list``,
``attach R``, ``cast RANKS CMD``, ``continue``) and ``%mesh pdb``, as Monarch's debugger has.

Runs in the kernel, for ``PdbHub``.  Ranks are named in the grammar of ``%%mesh --ranks``
(``runtime/rank_sets.py``).  It must never send a rank anything the user did not type, and a
mistake at the prompt is told there, never raised out of the cell.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from IPython.core.error import UsageError

from ...runtime import RankSpecError, parse_ranks, rank_label

if TYPE_CHECKING:
    from .pdb_controller import PdbHub
    from .rank_stop import RankStop

HELP = """\
(mesh pdb) commands:
  list                 the stopped ranks and where they stopped
  attach R             talk to rank R's pdb (type  detach  there to come back)
  cast RANKS CMD       send one pdb command to several ranks (RANKS: 0 | 0-3 | 0,2 | ::2)
  continue             continue every stopped rank
  help                 this text"""

MAGIC_USAGE = "type  %mesh pdb [list | attach R | cast RANKS CMD | continue | --post-mortem on|off]"


def describe(stops: list[RankStop]) -> str:
    """"ranks 0-1 stopped at cell line 4" for stops at one place."""
    s = stops[0]
    who = rank_label([x.rank for x in stops], brackets=False)
    if s.where.reason == "post-mortem":
        return f"{who} stopped after {s.where.error} at {s.place()} (post-mortem)"
    return f"{who} stopped at {s.place()}"


class PdbCommands:
    """The commands of the ``(mesh pdb)`` prompt and of ``%mesh pdb``, on one hub."""

    def __init__(self, hub: PdbHub):
        self.hub = hub

    # ------------------------------------------------------------ the (mesh pdb) prompt

    def prompt(self, waiting: list[RankStop]) -> str | None:
        """Read and run one command; "leave" when the user asked to leave the prompt."""
        hub = self.hub
        line = input("(mesh pdb) ").strip()
        cmd, _, rest = line.partition(" ")
        if cmd in ("list", "ls", ""):
            hub.write(self.listing() + "\n")
        elif cmd == "attach":
            stop = self._find(rest.strip(), waiting)
            if stop is not None:
                hub.attached, hub.chose_detach = stop.key, False
        elif cmd == "cast":
            spec, _, pdb_cmd = rest.strip().partition(" ")
            try:
                ranks = parse_ranks(spec, hub.rank_count(waiting))
            except RankSpecError as e:
                hub.write(f"cast {e}; type  cast RANKS CMD  with stopped ranks, e.g.  cast 0-3 p x\n")
                return None
            chosen = [s for s in waiting if s.rank in ranks]
            if not chosen or not pdb_cmd:
                hub.write("type  cast RANKS CMD  with stopped ranks, e.g.  cast 0-3 p x\n")
            hub.cast(chosen, pdb_cmd)
        elif cmd in ("continue", "c", "cont"):
            hub.cast(waiting, "c")
        elif cmd in ("detach", "quit", "q"):
            return "leave"
        else:
            hub.write(HELP + "\n")
        return None

    def _find(self, spec: str, waiting: list[RankStop]) -> RankStop | None:
        try:
            ranks = parse_ranks(spec, self.hub.rank_count(waiting))
        except RankSpecError as e:
            self.hub.write(f"attach {e}; type  attach R  with a stopped rank's number\n")
            return None
        if len(ranks) != 1:
            self.hub.write("type  attach R  with one stopped rank's number\n")
            return None
        for s in waiting:
            if s.rank == ranks[0]:
                return s
        self.hub.write(f"rank {ranks[0]} is not stopped; stopped: {self._stopped_ranks()}\n")
        return None

    def _stopped_ranks(self) -> str:
        return ", ".join(str(s.rank) for s in self.hub.waiting()) or "none"

    def listing(self) -> str:
        waiting = self.hub.waiting()
        if not waiting:
            return "no rank is stopped in pdb"
        rows = [f"  rank {s.rank} ({s.where.mesh}): {s.place()} in {s.where.function}"
                f"{' (post-mortem)' if s.where.reason == 'post-mortem' else ''}" for s in waiting]
        return "stopped in pdb:\n" + "\n".join(rows)

    # ------------------------------------------------------------ %mesh pdb

    def magic(self, args: list[str]) -> None:
        hub = self.hub
        if not args or args == ["list"]:
            print(self.listing())
            return
        cmd, rest = args[0], args[1:]
        if cmd == "--post-mortem":
            if rest not in (["on"], ["off"]):
                raise UsageError("type  %mesh pdb --post-mortem on  or  %mesh pdb --post-mortem off")
            hub.post_mortem = rest[0] == "on"
            for mesh in list(hub.host.meshes) + list(hub.api_meshes):
                hub.tell_ranks(mesh)
            print(f"post-mortem pdb {'on: a rank whose %%mesh cell raises stops in pdb' if hub.post_mortem else 'off'}")
            return
        waiting = hub.waiting()
        if cmd == "attach":
            if len(rest) != 1:
                raise UsageError("type  %mesh pdb attach R  (see  %mesh pdb  for the stopped ranks)")
            ranks = self._magic_ranks("attach", rest[0], waiting, "%mesh pdb attach 1")
            if len(ranks) != 1:
                raise UsageError(f"%mesh pdb attach {rest[0]}: attach takes one rank, e.g.  %mesh pdb attach 1")
            stop = next((s for s in waiting if s.rank == ranks[0]), None)
            if stop is None:
                raise UsageError(f"rank {rest[0]} is not stopped in pdb; stopped: {self._stopped_ranks()}")
            hub.attached, hub.chose_detach = stop.key, False
            hub.serve(leave_on_detach=True)
        elif cmd == "cast":
            if len(rest) < 2:
                raise UsageError("type  %mesh pdb cast RANKS CMD, e.g.  %mesh pdb cast 0-3 p x")
            ranks = self._magic_ranks("cast", rest[0], waiting, "%mesh pdb cast 0-1 p x")
            chosen = [s for s in waiting if s.rank in ranks]
            if not chosen:
                raise UsageError(f"none of ranks {rest[0]} is stopped in pdb; stopped: {self._stopped_ranks()}")
            hub.cast(chosen, " ".join(rest[1:]))
        elif cmd == "continue":
            if not waiting:
                print("no rank is stopped in pdb")
            hub.cast(waiting, "c")
        else:
            raise UsageError(MAGIC_USAGE)

    def _magic_ranks(self, cmd: str, spec: str, waiting: list[RankStop], example: str) -> list[int]:
        try:
            return parse_ranks(spec, self.hub.rank_count(waiting))
        except RankSpecError as e:
            raise UsageError(f"%mesh pdb {cmd} {e}; e.g.  {example}") from None
