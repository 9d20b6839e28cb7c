"""Threads that take part of a batch's checksums, started at the priority they must keep.

A Linux thread starts with the nice value and scheduling class of the thread that starts
it, and cannot lower its nice value again without privilege.  Core runs stores on
write-back threads (nice 10, idle-class while they copy) and loads at the process's
priority, so helper threads started on demand by whichever call needed one first -- in
practice a store -- ran every load's share of verification at nice 10, and the load waited
for it whenever the cores were busy.  Stores and loads therefore have helpers of their own:
a load's are started up front by the thread that creates the backend (at the process's
priority), a store's by the first store that needs one (at write-back's).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

__all__ = ["HelperThreads"]


class HelperThreads:
    """``count`` daemon threads, all started by the thread that creates the pool, so all
    at its priority (unlike ``ThreadPoolExecutor``'s, started by the first callers)."""

    def __init__(self, name: str, count: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue()
        )
        # Held while a job or the threads' ends are queued: a job queued after the ends
        # would never run, and its caller would wait for it forever.
        self._lock = threading.Lock()
        self._shut = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{index}", daemon=True) for index in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, function: Callable[..., T], *args: Any) -> Future[T]:
        """``function(*args)`` on a helper thread; raises ``RuntimeError`` once shut down
        (as an executor does): a call close left running reaches its checksums late."""
        future: Future[T] = Future()
        with self._lock:
            if self._shut:
                raise RuntimeError("the helper threads are shut down")
            self._jobs.put((future, function, args))
        return future

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, function, args = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(function(*args))
            except BaseException as exc:  # handed to the waiter, as an executor does
                future.set_exception(exc)

    def shutdown(self) -> None:
        """End the threads once the work already submitted is done."""
        with self._lock:
            self._shut = True
            for _ in self._threads:
                self._jobs.put(None)
        for thread in self._threads:
            thread.join()
