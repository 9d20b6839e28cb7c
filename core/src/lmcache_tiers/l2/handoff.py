"""Tasks handed to a few worker threads: in the order they came, each to the worker that
has been idle the shortest time.

A ``queue.SimpleQueue`` several workers wait on wakes them in turn (the kernel wakes a
lock's waiters first come, first served), so with ``num_workers`` of 4 every task of a
steady one-at-a-time stream wakes the worker idle the longest: cold caches, most likely
on the other core, and a wake-up that costs twice what waking the worker that ran the
task before does (measured through an instant backend: 35-45 us against ~20 us a task).
Here each idle worker waits on a lock of its own, and a task goes to the last one that
became idle; the others keep sleeping and are woken only when tasks come faster than one
worker ends them.  Tasks no worker is free for wait in a list, taken in order.
"""

from __future__ import annotations

import threading
from collections import deque
from queue import Empty
from typing import Generic, TypeVar

__all__ = ["Empty", "HandOff", "Worker"]

T = TypeVar("T")


class Worker(Generic[T]):
    """One worker thread's place in a :class:`HandOff`: where it sleeps while idle, and
    what it is handed on waking."""

    __slots__ = ("_item", "_wake")

    def __init__(self) -> None:
        self._wake = threading.Lock()
        self._wake.acquire()  # held while the worker has nothing: released to hand it a task
        self._item: T | None = None


class HandOff(Generic[T]):
    """``put`` and ``get`` as a ``SimpleQueue``'s, waking idle workers last-in, first-out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: deque[T] = deque()
        #: idle workers, the one idle the shortest time last
        self._idle: list[Worker[T]] = []

    def put(self, item: T) -> None:
        with self._lock:
            if not self._idle:
                self._waiting.append(item)
                return
            worker = self._idle.pop()
            worker._item = item
            worker._wake.release()

    def get(self, worker: Worker[T]) -> T:
        """The next task for ``worker`` (the calling thread's own), waited for while none."""
        self.ready(worker)
        return self.next(worker)

    def ready(self, worker: Worker[T]) -> None:
        """Count ``worker`` as idle from now on, before it has quite ended its task: it
        tells the task's waiter it ended, who may well submit the next one at once, and
        that one is then the ready worker's -- taken the moment it is done, not woken on
        another thread.  Its next task is then what :meth:`next` returns."""
        with self._lock:
            if self._waiting:
                worker._item = self._waiting.popleft()
                worker._wake.release()
            else:
                self._idle.append(worker)

    def next(self, worker: Worker[T]) -> T:
        """The task ``worker`` is handed after :meth:`ready`, waited for while none."""
        worker._wake.acquire()
        item, worker._item = worker._item, None
        return item  # type: ignore[return-value]  # handed before the release

    def get_nowait(self) -> T:
        """A task no worker has been handed yet; ``queue.Empty`` when there is none."""
        with self._lock:
            if not self._waiting:
                raise Empty
            return self._waiting.popleft()
