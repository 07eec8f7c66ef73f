"""A rank's main thread, lent to one actor: its sync endpoints run there, so an interrupt
can be a real SIGINT, which cuts blocking calls short (``time.sleep``, ``queue.get()``,
socket reads) the way the stop button does in ipykernel.  An asynchronous exception, the
only thing other threads can be given, waits until the blocking call returns.

The IO loop runs on a thread of its own in ranks; this thread only runs what it is handed.
"""

from __future__ import annotations

import ctypes
import queue
import signal
import sys
import threading
from collections.abc import Callable

_DEBUGGER_CODE = ("pydevd", "debugpy")


def _in_debugger(frame, depth: int = 8) -> bool:
    """Whether ``frame`` (or one of its few callers) is the debugger's own code."""
    while frame is not None and depth:
        name = frame.f_code.co_filename
        if any(part in name for part in _DEBUGGER_CODE):
            return True
        frame, depth = frame.f_back, depth - 1
    return False


class MainThread:
    def __init__(self):
        self.thread = threading.main_thread()
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._owner = None  # the ActorSlot that runs here, once one has claimed it

    def install(self) -> None:
        """On the main thread: take SIGINT, which only ever interrupts the owner's code."""
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, _signum, _frame) -> None:
        owner = self._owner
        if owner is not None and owner.busy():
            raise KeyboardInterrupt
        # Arrived between endpoints: nothing of the user's is running to interrupt.

    def claim(self, slot) -> bool:
        """Lend the thread to ``slot`` if nobody has it yet."""
        with self._lock:
            if self._owner is not None:
                return False
            self._owner = slot
            return True

    def release(self, slot) -> None:
        with self._lock:
            if self._owner is slot:
                self._owner = None

    def start(self, work: Callable[[], None]) -> None:
        self._work.put(work)

    def interrupt(self) -> None:
        """SIGINT to the main thread: a blocking call there returns at once (EINTR).

        Not while a debugger holds the thread at a breakpoint: debugpy would swallow an
        exception raised in its wait loop.  There, a pending asynchronous exception is set
        instead, which lands at the user's next line once the thread is resumed.
        """
        ident = self.thread.ident
        if _in_debugger(sys._current_frames().get(ident)):
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(KeyboardInterrupt))
            return
        signal.pthread_kill(ident, signal.SIGINT)

    def serve_forever(self) -> None:
        """The main thread's life: run what it is handed; the process ends it with _exit."""
        while True:
            work = self._work.get()
            try:
                work()
            except KeyboardInterrupt:  # an interrupt that landed just after the user's code
                continue
