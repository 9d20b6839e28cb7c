"""A heap the analysis oracles order their victims with, popped without losing entries.

``victims()`` must be lazy and the caller stops once enough is freed, so an oracle cannot
copy its whole heap for every eviction (that made them quadratic at large capacities).
Instead it pops from the heap itself and lends what it offered: the next call of any kind
pushes the lent entries back, except those no longer current -- the caller reports the
keys it evicted before calling anything else, so evicted keys are simply not taken back.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

Entry = TypeVar("Entry", bound=tuple[Any, ...])


class LendingHeap(Generic[Entry]):
    """Entries ordered smallest first; stale ones (``is_current`` false) are dropped lazily."""

    def __init__(self, is_current: Callable[[Entry], bool]) -> None:
        self._is_current = is_current
        self._entries: list[Entry] = []
        self._lent: list[Entry] = []

    def __len__(self) -> int:
        return len(self._entries)

    def push(self, entry: Entry) -> None:
        heapq.heappush(self._entries, entry)

    def rebuild(self, entries: Iterable[Entry]) -> None:
        """Replace every entry (when stale ones pile up, or all priorities change)."""
        self._lent.clear()
        self._entries = list(entries)
        heapq.heapify(self._entries)

    def take_back(self) -> None:
        """Push back what ``offer`` lent that is still current."""
        for entry in self._lent:
            if self._is_current(entry):
                heapq.heappush(self._entries, entry)
        self._lent.clear()

    def offer(self) -> Iterator[Entry]:
        """Current entries, smallest first, each lent until the next ``take_back``."""
        self.take_back()
        entries, lent, is_current = self._entries, self._lent, self._is_current
        while entries:
            entry = heapq.heappop(entries)
            if is_current(entry):
                lent.append(entry)
                yield entry
