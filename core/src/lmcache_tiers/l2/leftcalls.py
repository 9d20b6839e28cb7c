"""Threads for backend calls that may be left running past their timeout.

A call given up at its timeout keeps its thread until the backend's own timeout ends it,
possibly never.  A ``ThreadPoolExecutor``'s threads are joined when the interpreter
exits, so one such call would keep the server process from ever exiting; these threads
are daemons.  A thread is made only when no idle one is there (up to ``limit``), so a
healthy backend uses one or two, and a few stuck calls leave the rest free.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from queue import Empty, SimpleQueue
from typing import Any

__all__ = ["LeftCallThreads"]


class LeftCallThreads:
    """Runs calls on daemon threads; ``submit`` returns a Future, as an executor's does."""

    def __init__(self, limit: int, name: str) -> None:
        self.limit = limit
        self._name = name
        self._work: SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = SimpleQueue()
        self._idle = threading.Semaphore(0)  # one count per thread waiting for work
        self._lock = threading.Lock()
        self._threads = 0
        self._closed = False

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the helper threads are shut down")
            if not self._idle.acquire(blocking=False) and self._threads < self.limit:
                self._threads += 1
                threading.Thread(
                    target=self._serve, name=f"{self._name}_{self._threads}", daemon=True
                ).start()
            self._work.put((future, call))
        return future

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            future, call = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as exc:
                    future.set_exception(exc)
            del item, future  # the result is the caller's, not this idle thread's
            self._idle.release()

    def shutdown(self) -> None:
        """Cancel the calls not started yet and end every thread once its call returns."""
        with self._lock:
            self._closed = True
            threads = self._threads
        while True:
            try:
                item = self._work.get_nowait()
            except Empty:
                break
            if item is not None:
                item[0].cancel()
        for _ in range(threads):
            self._work.put(None)
