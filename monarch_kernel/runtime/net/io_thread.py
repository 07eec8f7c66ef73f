"""The IO thread: an asyncio loop of its own in every process.

It reads the inbox and pipes and resolves completions; it must never run user code that
can block (sync endpoints run on actor worker threads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

_get_ident = threading.get_ident


class IOThread:
    def __init__(self, name: str = "monarch-io"):
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()
        self._ident = self.thread.ident

    def _run(self):
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def is_current(self) -> bool:
        return _get_ident() == self._ident

    def call_soon(self, fn, *args) -> None:
        if self.is_current():
            self.loop.call_soon(fn, *args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def run(self, fn, *args, timeout: float | None = None):
        """Run ``fn`` on the IO thread and return its result (from any other thread)."""
        if self.is_current():
            return fn(*args)
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def go():
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed back to the waiting thread
                fut.set_exception(e)

        self.loop.call_soon_threadsafe(go)
        return fut.result(timeout)
