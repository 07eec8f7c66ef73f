"""The running cell's last line: a line a rank is still writing (a prompt, a progress bar),
else the cell's progress line, drawn below every finished line and redrawn in place.

A notebook can only rewrite the last line of a stream output (``\\r`` goes back to its start,
and what follows overwrites it), so one line at a time stands there: the one a rank wrote to
most recently (the same text on several ranks shows once, labelled with all of them).
Pure: it composes the text to write; ``kernel/output.py`` writes it, under its locks.
"""

from __future__ import annotations

from ..runtime import rank_label

Key = tuple[str, int, str]  # (mesh, rank, stream)
Shown = tuple[str, str, bool]  # (stream, text, whether it is the progress line)


def units(text: str) -> int:
    """How many blanks cover ``text`` in a notebook: one per UTF-16 unit, as JavaScript counts."""
    return len(text.encode("utf-16-le")) // 2


class CellTail:
    """What stands at the bottom of the running cell, and what to write to change it."""

    def __init__(self):
        self.open: dict[Key, tuple[int, str]] = {}  # lines being written: (order, text)
        self._order = 0
        self.progress: str | None = None
        self.summary: str | None = None  # the progress line as the cell ended
        self.on = False  # a cell is running: the line may show
        self.shown: Shown | None = None
        self.progress_shown = False  # in this cell
        self.wrote = False  # whether this cell shows finished lines
        self.last_stream = "stdout"

    def new_cell(self) -> None:
        self.shown, self.on = None, True
        self.progress = self.summary = None
        self.progress_shown = self.wrote = False

    def set_open(self, key: Key, text: str) -> bool:
        """The line ``key`` is writing is now ``text`` ("" once it ended); whether that changed."""
        was = self.open.get(key)
        if text:
            if was is not None and was[1] == text:
                return False
            self._order += 1
            self.open[key] = (self._order, text)
            return True
        if was is None:
            return False
        del self.open[key]
        return True

    def end_summary(self, has_lines: bool) -> str | None:
        """As the cell ends: the progress line it keeps (only when it showed nothing else: a
        stream output holding only blanks would be left in the notebook)."""
        summary = self.summary if self.progress_shown and not (has_lines or self.wrote) else None
        self.summary, self.progress_shown = None, False
        return summary

    def wanted(self, hold: bool) -> Shown | None:
        if not self.on:
            return None
        if self.open and not hold:
            (mesh, _r, stream), (_o, text) = max(self.open.items(), key=lambda kv: kv[1][0])
            ranks = [r for (m, r, s), (_o, t) in self.open.items() if m == mesh and s == stream and t == text]
            return stream, f"{rank_label(ranks)} {text}", False
        if self.progress:
            return self.last_stream, self.progress, True
        return None

    def pieces(self, due: list[tuple[str, str]], wanted: Shown | None,
               summary: str | None = None) -> list[tuple[str, str]]:
        """``(stream, text)`` to write: the finished lines ``due`` above the last line, which
        becomes ``wanted``; ``summary`` written once below everything as the cell ends."""
        tail = self.shown
        if not due and wanted == tail and summary is None:
            return []
        pieces: list[tuple[str, str]] = []
        if tail is not None and not due and summary is None and wanted is not None and wanted[0] == tail[0]:
            if wanted[1].startswith(tail[1]):
                pieces.append((wanted[0], wanted[1][len(tail[1]):]))  # the line goes on
            else:  # over the old one, blanking what it leaves (a notebook's \r keeps the rest)
                pieces.append((wanted[0], "\r" + wanted[1] + " " * (units(tail[1]) - units(wanted[1]))))
        else:
            if tail is not None and summary is not None and tail[2] and all(s != tail[0] for s, _t in due):
                # In its place: a stream's output is never left holding blanks alone.
                pieces.append((tail[0], f"\r{summary}{' ' * (units(tail[1]) - units(summary))}\n"))
                summary = None
            elif tail is not None:
                pieces.append((tail[0], "\r" + " " * units(tail[1]) + "\r"))
            pieces.extend(due)
            if due:
                self.last_stream, self.wrote = due[-1][0], True
            if summary is not None:
                pieces.append((tail[0] if tail is not None and tail[2] else self.last_stream, summary + "\n"))
            if wanted is not None:
                pieces.append((wanted[0], wanted[1]))
        self.shown = wanted
        self.progress_shown = self.progress_shown or (wanted is not None and wanted[2])
        return pieces
