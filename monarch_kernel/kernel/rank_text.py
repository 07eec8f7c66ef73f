"""What a rank writes, read as a terminal would show it: a stream of text cut into lines, where
``\\r``, ``\\b`` and ANSI cursor codes rewrite the line being written (a progress bar redraws
itself), colours are kept, and the cell-end sync marker is taken out wherever it falls.

Pure: no threads, no clock, no output.  A marker is honoured only with a token the kernel is
waiting for (a fresh random one per cell), so nothing a user prints can pass for one.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ..runtime import SYNC_MARK

SYNC = SYNC_MARK  # + 32 hex digits + "\n": what a rank writes, as one write, after each cell
_MARKER = re.compile(re.escape(SYNC_MARK) + "([0-9a-f]{32})\n")
_MARKER_LEN = len(SYNC) + 33
_SPECIAL = re.compile(r"[\r\b\x1b]")
# A CSI sequence (group 1: its parameters, 2: its final byte), an OSC (a window title), any
# other escape, or a carriage return or backspace.
_CONTROL = re.compile(r"\x1b\[([0-?]*)[ -/]*([@-~])|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]|[\r\b]")
_CUT_ESCAPE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b]*)?")  # an escape the chunk ends inside
_RESET = "\x1b[0m"
_RESETS = (_RESET, "\x1b[m")


def _number(params: str, default: int) -> int:
    try:
        return int(params) if params else default
    except ValueError:  # "?25", "1;2": not a count
        return default


class TermLine:
    """The line being written, as cells under a cursor: text at the cursor overwrites what is
    there (a terminal's rule, and Jupyter's), ``\\r`` goes back to the start, ``ESC[K`` erases.
    Cursor moves to other lines and screen codes are dropped: a cell has no screen.  Plain
    text without control characters takes a fast path (a string, no cells)."""

    __slots__ = ("plain", "cells", "col", "sgr", "held")

    def __init__(self):
        self.plain = ""
        self.cells: list[str] | None = None  # once a control character has been written
        self.col = 0
        self.sgr = ""  # colour codes that wait for the next character
        self.held = ""  # an escape sequence cut by the end of a chunk

    def __len__(self) -> int:
        return len(self.plain) if self.cells is None else len(self.cells)

    def write(self, text: str) -> None:
        if self.held:
            text, self.held = self.held + text, ""
        if self.cells is None:
            if not _SPECIAL.search(text):
                self.plain += text
                return
            self.cells, self.col, self.plain = list(self.plain), len(self.plain), ""
        esc = text.rfind("\x1b")
        if esc >= 0 and _CUT_ESCAPE.fullmatch(text, esc):
            text, self.held = text[:esc], text[esc:]
        pos = 0
        for m in _CONTROL.finditer(text):
            if m.start() > pos:
                self._put(text[pos:m.start()])
            pos = m.end()
            self._control(m)
        if pos < len(text):
            self._put(text[pos:])

    def text(self) -> str:
        """The line as shown; colours are reset at its end so they never run into the next."""
        if self.cells is None:
            return self.plain
        text = "".join(self.cells) + self.sgr
        last = text.rfind("\x1b[")
        return text if last < 0 or text.startswith(_RESETS, last) else text + _RESET

    def take(self) -> str:
        """The line as shown, and start a new one."""
        text = self.text()
        self.plain, self.cells, self.col, self.sgr, self.held = "", None, 0, "", ""
        return text

    def _put(self, s: str) -> None:
        cells = self.cells
        assert cells is not None
        col = self.col
        if col > len(cells):
            cells.extend(" " * (col - len(cells)))
        chars = list(s)
        if self.sgr:
            chars[0] = self.sgr + chars[0]
            self.sgr = ""
        cells[col:col + len(chars)] = chars
        self.col = col + len(chars)

    def _control(self, m: re.Match) -> None:
        cells = self.cells
        assert cells is not None
        code, final = m.group(0), m.group(2)
        if code == "\r":
            self.col = 0
        elif code == "\b":
            self.col = max(0, self.col - 1)
        elif final == "m":
            self.sgr += code
        elif final == "K":
            how = _number(m.group(1), 0)
            if how == 0:
                del cells[self.col:]
            elif how == 1:
                cells[:self.col] = " " * min(self.col, len(cells))
            else:
                cells.clear()
        elif final == "G":
            self.col = max(0, _number(m.group(1), 1) - 1)
        elif final == "C":
            self.col += _number(m.group(1), 1)
        elif final == "D":
            self.col = max(0, self.col - _number(m.group(1), 1))
        # Anything else (cursor up or down, hide the cursor, a window title) has no meaning in a cell.


class RankText:
    """One rank's stdout or stderr: ``feed(text)`` returns what completed, in order, as
    ``("line", text)`` and ``("sync", token)``; ``open()`` is the line being written.

    ``honoured(token)`` says whether a marker's token is one the kernel waits for; any other
    marker-like text is the user's and shows as written.  A marker ends the line before it
    (what a cell leaves unfinished ends with the cell, as in IPython).
    """

    __slots__ = ("line", "honoured", "max_chars", "carry")

    def __init__(self, honoured: Callable[[str], bool], max_chars: int):
        self.line = TermLine()
        self.honoured = honoured
        self.max_chars = max_chars
        self.carry = ""  # the start of what may be a marker, cut by the end of a chunk

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.carry:
            text, self.carry = self.carry + text, ""
        if "\x1e" in text:
            pos = 0
            for m in _MARKER.finditer(text):
                if self.honoured(m.group(1)):
                    self._text(text[pos:m.start()], out)
                    if len(self.line) or self.line.held:
                        out.append(("line", self.line.take()))
                    out.append(("sync", m.group(1)))
                    pos = m.end()
            text = text[pos:]
            cut = text.rfind("\x1e")
            if cut >= 0 and len(text) - cut < _MARKER_LEN and "\n" not in text[cut:]:
                text, self.carry = text[:cut], text[cut:]
        self._text(text, out)
        return out

    def open(self) -> str:
        return self.line.text()

    def close(self) -> str | None:
        """End the line being written (the cell ended, or the rank): its text, if any."""
        if self.carry:
            self._text(self.carry, [])
            self.carry = ""
        return self.line.take() if len(self.line) else None

    def _text(self, text: str, out: list) -> None:
        if not text:
            return
        parts = text.split("\n")
        line = self.line
        for part in parts[:-1]:
            line.write(part)
            out.append(("line", line.take()))
        line.write(parts[-1])
        if len(line) > self.max_chars:  # a line that never ends is shown in pieces, as before
            out.append(("line", line.take()))
