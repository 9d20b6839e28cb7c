"""DeleteMarks: what a backend's delete leaves for the lookup core makes right after it.

A delete that finds something it must not remove under a key's name (another writer's
object) counts it and marks the key, so that the lookup core makes next -- to see
whether the key is still there -- treats it as the delete already judged it.  That
lookup may never come (the absence check is skipped for a pinned key, an open circuit, a
close; the object may vanish first), so a mark is kept only until it is taken or until
:data:`KEPT_MARKS_LIMIT` newer ones push it out: a forgotten mark may cost that key's
next lookup some work or a second count, never a wrong answer, and is counted and logged.
``KeptByDelete`` keeps such marks for records, with the verdict each delete counted.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

from lmcache_tiers.l2.context import KEPT_MARKS_LIMIT, BackendContext

T = TypeVar("T", bound=Hashable)


class DeleteMarks(Generic[T]):
    """At most ``limit`` marks (keys or names), the oldest forgotten first, counted as
    ``counter`` and explained by ``forgotten_means`` (what the next lookup of a key
    whose mark was forgotten does) in a log line.  Thread-safe."""

    def __init__(
        self, context: BackendContext, counter: str, forgotten_means: str, limit: int = KEPT_MARKS_LIMIT
    ) -> None:
        self._context = context
        self._counter = counter
        self._forgotten_means = forgotten_means
        self._limit = limit
        self._lock = threading.Lock()
        #: oldest first (insertion order), at most ``limit``
        self._marks: dict[T, None] = {}

    def __bool__(self) -> bool:
        # Read without the lock: lookups test it on every call, and a mark added as it
        # is read is one the lookup could equally have come before.
        return bool(self._marks)

    def __len__(self) -> int:
        return len(self._marks)

    def add(self, member: T) -> None:
        """Mark ``member`` (again: as the newest)."""
        self.add_all((member,))

    def add_all(self, members: Iterable[T]) -> None:
        with self._lock:
            for member in members:
                self._marks.pop(member, None)
                self._marks[member] = None
            excess = len(self._marks) - self._limit
            oldest = list(itertools.islice(self._marks, max(excess, 0)))
            for stale in oldest:
                del self._marks[stale]
        if oldest:
            self._context.count(self._counter, len(oldest))
            self._context.warn(
                self._counter,
                "%d marks deletes left for the next lookup of their key were not taken; "
                "forgotten (at most %d are kept), so %s",
                len(oldest),
                self._limit,
                self._forgotten_means,
            )

    def take(self, member: T) -> bool:
        """Whether ``member`` was marked; taking forgets the mark."""
        with self._lock:
            if member not in self._marks:
                return False
            del self._marks[member]
            return True

    def take_all(self, members: Iterable[T]) -> set[T]:
        """Those of ``members`` that were marked; taking forgets their marks."""
        with self._lock:
            taken = {member for member in members if member in self._marks}
            for member in taken:
                del self._marks[member]
        return taken
