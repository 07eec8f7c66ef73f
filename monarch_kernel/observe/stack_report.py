"""``StackReport``: every selected rank's thread stacks, ranks with the same stacks grouped.

What ``procs.stacks()`` and ``%mesh stacks`` return.  Hundreds of ranks usually come down to
a few groups: the groups that differ from the majority come first, since the odd rank out
is the one holding the others up.  Frames of monarch_kernel itself are folded away (and
threads that run nothing but them, such as its IO thread, are left out) unless asked for.
Pure data and text; it knows nothing of processes.
"""

from __future__ import annotations

import html
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field

from ..runtime import counted, rank_label

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = sysconfig.get_path("stdlib") + os.sep


@dataclass(frozen=True)
class Frame:
    name: str
    filename: str
    line: int

    @property
    def ours(self) -> bool:
        """A frame of monarch_kernel itself (on the rank's host the package may live
        elsewhere, so its folder name is what counts)."""
        return self.filename.startswith(_PACKAGE) or f"{os.sep}monarch_kernel{os.sep}" in self.filename

    @property
    def stdlib(self) -> bool:
        """The standard library's, or the interpreter's own entry (``python -c``, frozen modules)."""
        if self.filename in ("<string>", "") or self.filename.startswith("<frozen"):
            return True
        return self.filename.startswith(_STDLIB) or f"{os.sep}lib{os.sep}python3." in self.filename \
            and "site-packages" not in self.filename and "dist-packages" not in self.filename

    def __str__(self) -> str:
        where = os.path.basename(self.filename) if self.filename else "?"
        return f"{self.name} ({where}:{self.line})" if self.line else f"{self.name} ({where})"


# The outermost frame of a process started by ``python -c`` (as ranks are): dropped from stacks.
ENTRY = Frame("<module>", "<string>", 1)


@dataclass(frozen=True)
class ThreadStack:
    name: str
    frames: tuple[Frame, ...]  # innermost first
    gil: bool = False

    def shown(self, runtime_frames: bool) -> tuple[Frame, ...]:
        return self.frames if runtime_frames else tuple(f for f in self.frames if not f.ours)

    def runs_user_code(self) -> bool:
        """Whether any frame is neither monarch_kernel's nor the standard library's."""
        return any(not f.ours and not f.stdlib for f in self.frames)


@dataclass
class RankStack:
    """One rank's threads; ``method`` says how they were taken (``py-spy``, ``py-spy
    --native``, or ``in-process``, with why py-spy was not used); ``error``: why there is
    no stack at all."""

    rank: int
    host: str
    method: str
    threads: list[ThreadStack] = field(default_factory=list)
    error: str = ""

    def key(self, all_threads: bool, runtime_frames: bool) -> tuple:
        if self.error:
            return ("error", self.error)
        return tuple((t.name, t.shown(runtime_frames)) for t in self.selected(all_threads))

    def selected(self, all_threads: bool) -> list[ThreadStack]:
        return self.threads if all_threads else [t for t in self.threads if t.runs_user_code()]


def from_json(rank: int, host: str, method: str, threads: list) -> RankStack:
    """A ``RankStack`` from py-spy's ``dump --json`` list (or the rank's own, in that shape);
    ``ValueError`` on anything else."""
    if not isinstance(threads, list):
        raise ValueError("a stack dump is a list of threads")
    out = []
    for t in threads:
        frames = tuple(Frame(str(f.get("name") or "?"), str(f.get("filename") or ""), int(f.get("line") or 0))
                       for f in t.get("frames") or ())
        if frames and frames[-1] == ENTRY:  # the rank's ``python -c``: it says nothing of where the rank is
            frames = frames[:-1]
        out.append(ThreadStack(str(t.get("thread_name") or f"thread {t.get('thread_id', '?')}"), frames,
                               bool(t.get("owns_gil"))))
    out.sort(key=lambda t: (t.name != "MainThread", t.name))
    return RankStack(rank, host, method, out)


@dataclass
class StackGroup:
    ranks: list[int]
    sample: RankStack  # one of them: they all have these stacks

    def label(self) -> str:
        return rank_label(self.ranks)


#: How a frame is shown, when the caller knows better than its file name (the kernel names a
#: notebook cell ``cell [5], line 4: ...``); None: as ``str(frame)``.
FrameNamer = Callable[[Frame], "str | None"]


class StackReport:
    """The grouped stacks of ``mesh``'s selected ranks (``groups``, odd ones first)."""

    def __init__(self, mesh: str, stacks: list[RankStack], *, all_threads: bool = False,
                 runtime_frames: bool = False):
        self.mesh = mesh
        self.frame_namer: FrameNamer | None = None
        self.stacks = sorted(stacks, key=lambda s: s.rank)
        self.all_threads = all_threads
        self.runtime_frames = runtime_frames
        groups: dict[tuple, StackGroup] = {}
        for s in self.stacks:
            k = s.key(all_threads, runtime_frames)
            if k in groups:
                groups[k].ranks.append(s.rank)
            else:
                groups[k] = StackGroup([s.rank], s)
        # The majority last; the smallest (the odd ones out) first; of groups as large, idle ones later.
        self.groups = sorted(groups.values(), key=lambda g: (len(g.ranks), self._idle(g), g.ranks[0]))

    def name_frames(self, namer: FrameNamer | None) -> StackReport:
        """Show frames through ``namer`` (its None: the frame as it is); returns the report."""
        self.frame_namer = namer
        return self

    def frame_text(self, f: Frame) -> str:
        """How frame ``f`` is shown."""
        named = self.frame_namer(f) if self.frame_namer is not None else None
        return named or str(f)

    def _idle(self, g: StackGroup) -> bool:
        return not g.sample.error and not any(frames for _name, frames in self._threads(g))

    def odd_ranks(self) -> list[int]:
        """The ranks outside the largest group (the ones whose stacks differ from the majority)."""
        return sorted(r for g in self.groups[:-1] for r in g.ranks) if len(self.groups) > 1 else []

    def methods(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for s in self.stacks:
            out.setdefault(s.method, []).append(s.rank)
        return out

    def _threads(self, g: StackGroup) -> list[tuple[str, tuple[Frame, ...]]]:
        return [(t.name, t.shown(self.runtime_frames)) for t in g.sample.selected(self.all_threads)]

    def summary(self) -> list[str]:
        """One line per group: ``[rank 3] sleep (data.py:17) ← load (data.py:17) ← …``."""
        lines = []
        for g in self.groups:
            if g.sample.error:
                lines.append(f"{g.label()} no stack: {g.sample.error}")
                continue
            threads = [(n, f) for n, f in self._threads(g) if f]
            if not threads:
                lines.append(f"{g.label()} idle: no user code running")
                continue
            name, frames = threads[0]
            chain = " ← ".join(self.frame_text(f) for f in frames[:4]) + (" ← …" if len(frames) > 4 else "")
            more = f"  (+{counted(len(threads) - 1, 'more thread')})" if len(threads) > 1 else ""
            lines.append(f"{g.label()} {chain}{more}")
        return lines

    def __repr__(self) -> str:
        head = (f"Stacks of mesh '{self.mesh}': {counted(len(self.stacks), 'rank')} in "
                f"{counted(len(self.groups), 'group')}")
        how = "; ".join(f"{m}: {rank_label(rs, brackets=False)}" for m, rs in self.methods().items())
        out = [head, f"  taken by {how}", *self.summary(), ""]
        for g in self.groups:
            if g.sample.error:
                continue
            out.append(f"{g.label()}")
            for name, frames in self._threads(g):
                out.append(f"  thread {name}:")
                out.extend(f"    {self.frame_text(f)}" for f in frames)
                if not frames:
                    out.append("    (only monarch_kernel frames)")
        return "\n".join(out).rstrip()

    def _repr_html_(self) -> str:
        rows = []
        for g in self.groups:
            if g.sample.error:
                body = f"<i>no stack: {html.escape(g.sample.error)}</i>"
            else:
                blocks = []
                for name, frames in self._threads(g):
                    items = "".join(f"<li><code>{html.escape(self.frame_text(f))}</code></li>" for f in frames)
                    blocks.append(f"<b>{html.escape(name)}</b><ol style='margin:0'>{items or '<li>idle</li>'}</ol>")
                body = "".join(blocks) or "<i>idle: no user code running</i>"
            odd = " style='background:#fff3cd'" if len(self.groups) > 1 and g is not self.groups[-1] else ""
            rows.append(f"<tr{odd}><td style='vertical-align:top'><b>{html.escape(g.label())}</b></td>"
                        f"<td style='text-align:left'>{body}</td></tr>")
        how = "; ".join(f"{html.escape(m)}: {html.escape(rank_label(rs, brackets=False))}"
                        for m, rs in self.methods().items())
        return (f"<div class='monarch-stacks'><b>Stacks of mesh '{html.escape(self.mesh)}'</b>: "
                f"{counted(len(self.stacks), 'rank')} in {counted(len(self.groups), 'group')} <small>({how})</small>"
                f"<table>{''.join(rows)}</table></div>")
