"""Unfinished messages: the pieces of a same-host message too large for one datagram
(``datagram.py``), held until its last piece comes.  A message is begun only by a first piece
whose head carries a MAC with a key of the job (the listener checks it: a process of the same
user without the key holds nothing here, ``forged``), but the message's own signature can be
checked only once it is whole, so what is held is bounded, as ZeroMQ's frames are
(``MONARCH_KERNEL_MAX_WIRE_FRAME``), against the job's own senders (many large messages at
once, a sender that stops mid-message); what goes past a bound is dropped, counted on the
``datagram`` wire of ``rejects`` (``Runtime.stats()["rejected"]``) and logged there.

- one message: the length its first piece declares, at most ``max_message`` (refused at that
  first piece), and no more pieces or bytes than that length needs;
- all of a process's inboxes together: at most ``MAX_MESSAGES`` messages and
  ``MONARCH_KERNEL_UNFINISHED_MEMORY`` bytes (64 MiB unless set), the message fed least recently
  going first; the one being fed is never dropped for room, so one message alone may be
  larger (up to its own bound above), and a sender of many unfinished pieces cannot grow a
  process past the bound;
- age: a message whose link has sent nothing for ``MONARCH_KERNEL_UNFINISHED_TIMEOUT``
  seconds, counted from a moment when its inbox had been read to the end (a reader that is
  busy or slow never ages its senders; only a sender that stops does).  It is looked at when
  the inbox is read: one that nobody reads keeps what it holds, within the bounds above,
  until its next message.
``Runtime.stats()["unfinished"]`` says what is held.  Nothing here reads a socket; importing
it starts nothing.
"""

from __future__ import annotations

import collections
import threading
import time

from ..wire import rejects

WIRE = "datagram"
MAX_MESSAGES = 256  # unfinished messages a process holds at once, across its inboxes


class _Message:
    __slots__ = ("joiner", "link", "total", "got", "held", "count", "most", "parts", "last")

    def __init__(self, joiner: Joiner, link: bytes, total: int, most: int):
        self.joiner = joiner
        self.link = link
        self.total = total  # the length its first piece declared
        self.got = 0  # bytes of it so far
        self.held = 0  # bytes of datagrams held for it (what ``Held.bytes`` counts)
        self.count = 0  # pieces so far
        self.most = most  # pieces that length needs
        self.parts: list = []
        self.last = 0.0  # when its last piece came (monotonic)


class Held:
    """Every unfinished message of this process, least recently fed first, and their bytes.
    One lock for all: taken once per piece (never for a message of one datagram)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.order: collections.OrderedDict[_Message, None] = collections.OrderedDict()
        self.bytes = 0

    def snapshot(self) -> dict:
        with self.lock:
            return {"messages": len(self.order), "bytes": self.bytes}


HELD = Held()


def held() -> dict:
    """``{"messages": n, "bytes": b}`` held in unfinished messages by this process now."""
    return HELD.snapshot()


class Joiner:
    """One listener's unfinished messages, by the id of the link that sends each; ``HELD``
    bounds them together with every other listener's.  ``first_size`` and ``piece_size``:
    the data a sender puts in a message's first piece and in each piece after it."""

    def __init__(self, max_message: int, stale_s: float, first_size: int, piece_size: int, budget: int):
        self.max_message = max_message
        self.budget = budget
        self.stale_s = stale_s
        self.first_size = first_size
        self.piece_size = piece_size
        self.open: dict[bytes, _Message] = {}  # (changed under HELD.lock only)
        # Links whose message was dropped: the rest of its pieces go quietly, until its next first piece.
        self._refused: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._mark: float | None = None  # when the listener was first seen read to the end, since the last sweep

    def first(self, link: bytes, total: int, part, size: int) -> None:
        """The first piece (``part``, from a datagram of ``size`` bytes) of a message of ``total`` bytes."""
        drops: list[tuple[str, str]] = []
        with HELD.lock:
            old = self.open.get(link)
            if old is not None:
                self._drop(old, drops, "malformed", "a message began before the one before it ended")
            self._refused.pop(link, None)
            if total > self.max_message:
                self._refuse(link)
                drops.append(("oversized", f"a message of {total} bytes announced, over the {self.max_message} "
                                           "bytes of MONARCH_KERNEL_MAX_FRAME; refused at its first piece"))
            elif total <= len(part):
                self._refuse(link)
                drops.append(("malformed", f"a first piece of {len(part)} bytes for a message of {total}"))
            else:
                most = 1 + -(-(total - min(total, self.first_size)) // self.piece_size)
                msg = _Message(self, link, total, most)
                self.open[link] = msg
                HELD.order[msg] = None
                while len(HELD.order) > MAX_MESSAGES:
                    victim = next(iter(HELD.order))
                    self._evict(victim, drops, "too_many", f"more than {MAX_MESSAGES} unfinished messages at once")
                self._add(msg, part, size, drops)
        _count(drops)

    def piece(self, link: bytes, part, size: int, last: bool) -> bytes | None:
        """A piece after the first; the whole message's bytes when it is the ``last``."""
        drops: list[tuple[str, str]] = []
        whole = None
        with HELD.lock:
            msg = self.open.get(link)
            n = len(part)
            if msg is None:
                if link in self._refused:  # the rest of a message dropped already: counted then
                    if last:
                        del self._refused[link]
                else:
                    drops.append(("orphan", "a piece of no message begun (its first piece never came)"))
            elif msg.count >= msg.most or msg.got + n > msg.total or (last and msg.got + n != msg.total):
                self._drop(msg, drops, "malformed", f"pieces that do not add up to the {msg.total} bytes announced")
                if last:
                    self._refused.pop(link, None)
            elif last:
                self._forget(msg)
                msg.parts.append(part)
                whole = msg.parts
            else:
                self._add(msg, part, size, drops)
        _count(drops)
        return b"".join(whole) if whole is not None else None

    def drained(self) -> None:
        """The listener was read to the end: every piece sent to it so far has come.  A
        message whose last piece came before such a moment, ``stale_s`` or more ago, is dropped."""
        drops: list[tuple[str, str]] = []
        now = time.monotonic()
        with HELD.lock:
            if not self.open:
                self._mark = None
                return
            if self._mark is None:
                self._mark = now
                return
            if now - self._mark < self.stale_s:
                return
            mark = self._mark
            for msg in [m for m in self.open.values() if m.last < mark]:
                self._drop(msg, drops, "stale", f"its sender sent nothing for {now - msg.last:.0f} s (at most "
                                                f"MONARCH_KERNEL_UNFINISHED_TIMEOUT, {self.stale_s:g} s)")
            self._mark = now if self.open else None
        _count(drops)

    def close(self) -> None:
        """Its listener closed: what it held is let go (it counts against every listener's room)."""
        with HELD.lock:
            for msg in list(self.open.values()):
                self._forget(msg)
            self._refused.clear()

    # -------------------------------------------------- (all below: holding HELD.lock)

    def _add(self, msg: _Message, part, size: int, drops: list) -> None:
        HELD.order.move_to_end(msg)
        while HELD.bytes + size > self.budget and len(HELD.order) > 1:
            victim = next(iter(HELD.order))  # never ``msg``: it is the last
            self._evict(victim, drops, "too_much", f"{HELD.bytes} bytes held in unfinished messages, at most "
                                                   f"MONARCH_KERNEL_UNFINISHED_MEMORY ({self.budget})")
        msg.parts.append(part)
        msg.got += len(part)
        msg.count += 1
        msg.held += size
        msg.last = time.monotonic()
        HELD.bytes += size

    def _evict(self, victim: _Message, drops: list, reason: str, why: str) -> None:
        victim.joiner._drop(victim, drops, reason, f"{why}: the one fed least recently ({victim.got} of "
                                                   f"{victim.total} bytes) was dropped")

    def _drop(self, msg: _Message, drops: list, reason: str, detail: str) -> None:
        self._forget(msg)
        self._refuse(msg.link)
        drops.append((reason, detail))

    def _forget(self, msg: _Message) -> None:
        del self.open[msg.link]
        del HELD.order[msg]
        HELD.bytes -= msg.held
        if not self.open:
            self._mark = None

    def _refuse(self, link: bytes) -> None:
        self._refused[link] = None
        if len(self._refused) > MAX_MESSAGES:
            self._refused.popitem(last=False)


def _count(drops: list[tuple[str, str]]) -> None:
    for reason, detail in drops:
        rejects.count(WIRE, reason, detail)
