"""Task ids, completed results and one eventfd per operation kind."""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from lmcache_tiers.l2.interface import L2Op, LookupResult


def failure_result(op: L2Op, count: int) -> list[bool] | LookupResult:
    """What a task of ``count`` keys reports when it could not run at all."""
    if op is L2Op.LOOKUP:
        return LookupResult.misses(count)
    return [False] * count


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


@dataclass
class _Pending:
    op: L2Op
    count: int


class TaskBoard:
    """Hands out task ids, keeps results until popped and signals the eventfds.

    An eventfd in counter mode is written once per completed task and drained (reset to
    zero) by ``pop`` *before* results are collected: a task finishing in between is either
    popped now (leaving a harmless spurious wake-up) or leaves the fd readable.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._done: dict[L2Op, dict[int, Any]] = {op: {} for op in L2Op}
        self._fds = {op: os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for op in L2Op}
        # The fds outlive close(): a controller still polling must never see a descriptor
        # number that was closed and handed to another file.
        self._finalizer = weakref.finalize(self, _close_fds, list(self._fds.values()))

    def event_fd(self, op: L2Op) -> int:
        return self._fds[L2Op(op)]

    def new_task(self, op: L2Op, count: int) -> int:
        with self._lock:
            task_id = next(self._ids)
            self._pending[task_id] = _Pending(op, count)
            return task_id

    def complete(self, task_id: int, result: Any) -> bool:
        """Publish a result; False if the task was already failed (e.g. by close)."""
        with self._lock:
            pending = self._pending.pop(task_id, None)
            if pending is None:
                return False
            self._done[pending.op][task_id] = result
        os.eventfd_write(self._fds[pending.op], 1)
        return True

    def fail(self, task_id: int) -> bool:
        with self._lock:
            pending = self._pending.get(task_id)
        if pending is None:
            return False
        return self.complete(task_id, failure_result(pending.op, pending.count))

    def fail_all_pending(self) -> int:
        with self._lock:
            task_ids = list(self._pending)
        return sum(self.fail(task_id) for task_id in task_ids)

    def pending_count(self) -> int:
        with self._lock:
            return len(self._pending)

    def pop(self, op: L2Op) -> dict[int, Any]:
        try:
            os.eventfd_read(self._fds[op])
        except BlockingIOError:
            pass
        with self._lock:
            done = self._done[op]
            self._done[op] = {}
        return done

    def release_fds(self) -> None:
        """Close the eventfds now (only when nobody can be polling them any more)."""
        self._finalizer()
