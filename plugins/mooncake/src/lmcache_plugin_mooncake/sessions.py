"""Mooncake get sessions shared by the adapter's loads running at once.

A get session (``batch_get_session_start``) asks the master for the replicas of a batch
of names once and keeps them in the client; ``batch_get_into_multi_buffer_ranges`` then
reads each record's header and payload in one transfer, with no master round trip of its
own (``batch_get_session_end`` forgets them).  The client keeps one session per name,
not one per caller: a second start of a name replaces it, and one end drops it under
every other load still reading it (their reads fail, -600: a miss).  So the loads of a
name are counted here and only the last one to finish ends its session -- under the same
lock that counts a load in, so an end never falls between a later load's count and its
start.  (Ending is local to the client: no master round trip under the lock.)  A start
that fails (the object gone since) drops the name's session as well: a load still
reading it then misses, counted as a failed read.

A session keeps the replica it started with: an object removed since is read from the
memory it had, which the pool may have given to another object by then -- a torn or
foreign record that the load's verification turns into a counted miss.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["GetSessions"]


class GetSessions:
    """How many loads read each name under its get session, and the session's end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readers: dict[str, int] = {}

    @contextmanager
    def started(self, store: Any, names: list[str]) -> Iterator[list[int]]:
        """Start the get sessions of ``names`` on ``store``: Mooncake's code per name (0:
        started); each is ended, once no other load reads it, when the block ends."""
        with self._lock:
            for name in names:
                self._readers[name] = self._readers.get(name, 0) + 1
        try:
            yield list(store.batch_get_session_start(names))
        finally:
            self._finish(store, names)

    def _finish(self, store: Any, names: list[str]) -> None:
        with self._lock:
            last: list[str] = []
            for name in names:
                left = self._readers[name] - 1
                if left:
                    self._readers[name] = left
                else:
                    del self._readers[name]
                    last.append(name)
            if last:
                store.batch_get_session_end(last)

    @property
    def open(self) -> int:
        """Names read under a session right now."""
        with self._lock:
            return len(self._readers)
