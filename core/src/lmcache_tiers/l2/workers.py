"""Spreading the objects of one batch over a few threads.

Backends that move bytes with calls releasing the GIL (system calls, numpy copies,
xxhash) move a batch's objects on several threads at once.  One task per thread, each
taking the next object not yet taken until none is left, rather than one task per
object: handing a future to a pool and collecting it costs tens of microseconds, a
noticeable share of a 1 MiB copy.  The calling thread works too, so a batch costs one
hand-off per extra thread; and as objects are taken one at a time, a thread that gets
less CPU (write-back runs at a low priority on a busy machine) does fewer of them
instead of holding the batch up with a fixed share.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from lmcache_tiers.l2.background import WRITE_BACK

__all__ = ["BatchWorkers"]

R = TypeVar("R")


class BatchWorkers:
    """``count`` threads for the objects of a batch: the caller's and ``count - 1`` more."""

    def __init__(self, count: int, name: str, *, background: bool = False) -> None:
        self.count = max(1, count)
        self._pool = ThreadPoolExecutor(self.count - 1, thread_name_prefix=name) if self.count > 1 else None
        # A store batch's helpers do write-back work like the thread that calls them, so
        # they take the write-back threads' priority (l2/background.py); otherwise half
        # of a batch would run at full priority beside the requests it should yield to.
        self._background = background
        self._members: set[int] = set()

    def map(self, work: Callable[..., R], *columns: Sequence[Any], parallel: bool = True) -> list[R]:
        """``work(a, b, ...)`` for every row of the columns, results in order, like ``map``.

        Every row is worked on even when one raises (a store must settle each object it
        started); the first exception is raised once all are done.  ``parallel=False``
        (a batch too small to be worth a hand-off) runs every row on the calling thread.
        """
        rows = list(zip(*columns, strict=True))
        pool = self._pool
        helpers = min(self.count, len(rows)) - 1 if parallel and pool is not None else 0
        results: list[R] = [None] * len(rows)  # type: ignore[list-item]
        errors: list[BaseException] = []
        # next() of an itertools.count is atomic under the GIL: each row is taken once.
        taken = itertools.count()

        def drain() -> None:
            while (index := next(taken)) < len(rows):
                try:
                    results[index] = work(*rows[index])
                except BaseException as exc:
                    errors.append(exc)

        def helper() -> None:
            if self._background:
                self._join_write_back()
            drain()

        others: list[Future[None]] = [pool.submit(helper) for _ in range(helpers)] if pool else []
        try:
            drain()
        finally:
            for other in others:
                other.result()
        if errors:
            raise errors[0]
        return results

    def _join_write_back(self) -> None:
        tid = threading.get_native_id()
        if tid not in self._members:  # once per pool thread: its priority stays set
            self._members.add(tid)
            WRITE_BACK.enter()

    def shutdown(self, *, wait: bool = True) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=wait)
        if self._members:
            WRITE_BACK.forget(self._members)
            self._members = set()
