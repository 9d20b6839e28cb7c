"""Running the per-object work of one batch on a few worker threads.

One task per worker, each taking every n-th object, rather than one task per object:
handing a future to a pool costs tens of microseconds, a noticeable share of a 1 MiB
copy.  With one worker (or one object) the work runs on the calling thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

R = TypeVar("R")


class Workers:
    """A fixed number of threads for the objects of a batch."""

    def __init__(self, count: int, name: str) -> None:
        self.count = count
        self._pool = ThreadPoolExecutor(count, thread_name_prefix=name) if count > 1 else None

    def map(self, work: Callable[..., R], *columns: Sequence[Any]) -> list[R]:
        """``work(a, b, ...)`` for every row of the columns, in order, like ``map``.
        Every row is worked on even when one raises (a store must settle each slot it
        claimed); the first exception is then raised."""
        items = list(zip(*columns, strict=True))
        stride = 1 if self._pool is None else max(1, min(self.count, len(items)))
        results: list[R] = [None] * len(items)  # type: ignore[list-item]
        errors: list[BaseException] = []

        def share(first: int) -> None:
            for index in range(first, len(items), stride):
                try:
                    results[index] = work(*items[index])
                except BaseException as exc:
                    errors.append(exc)

        if self._pool is None or stride == 1:
            share(0)
        else:
            list(self._pool.map(share, range(stride)))
        if errors:
            raise errors[0]
        return results

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
