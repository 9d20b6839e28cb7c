"""Spreading the objects of one batch over a few threads, a share of objects per thread.

Backends that move bytes with calls releasing the GIL (system calls, numpy copies,
xxhash) move a batch's objects on several threads at once.  One task per thread, each
taking every n-th object, rather than one task per object: handing a future to a pool
and collecting it costs tens of microseconds, a noticeable share of a 1 MiB copy.  The
calling thread works one share itself, so a batch costs one hand-off per extra thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["BatchWorkers"]

R = TypeVar("R")


class BatchWorkers:
    """``count`` threads for the objects of a batch: the caller's and ``count - 1`` more."""

    def __init__(self, count: int, name: str) -> None:
        self.count = max(1, count)
        self._pool = ThreadPoolExecutor(self.count - 1, thread_name_prefix=name) if self.count > 1 else None

    def map(self, work: Callable[..., R], *columns: Sequence[Any], parallel: bool = True) -> list[R]:
        """``work(a, b, ...)`` for every row of the columns, results in order, like ``map``.

        Every row is worked on even when one raises (a store must settle each object it
        started); the first exception is raised once all are done.  ``parallel=False``
        (a batch too small to be worth a hand-off) runs every row on the calling thread.
        """
        rows = list(zip(*columns, strict=True))
        pool = self._pool
        stride = max(1, min(self.count, len(rows))) if parallel and pool is not None else 1
        results: list[R] = [None] * len(rows)  # type: ignore[list-item]
        errors: list[BaseException] = []

        def share(first: int) -> None:
            for index in range(first, len(rows), stride):
                try:
                    results[index] = work(*rows[index])
                except BaseException as exc:
                    errors.append(exc)

        others: list[Future[None]] = [pool.submit(share, first) for first in range(1, stride)] if pool else []
        try:
            share(0)
        finally:
            for other in others:
                other.result()
        if errors:
            raise errors[0]
        return results

    def shutdown(self, *, wait: bool = True) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=wait)
