"""Keys waiting in the order of their stamps, for eviction policies' ``put_back``.

A policy that sets locked keys aside (``EvictionPolicy.set_aside``) gives each a stamp
(ascending = set aside earlier) and, once put back, offers them in stamp order while
thousands may wait and one more comes back each write.  ``StampedKeys`` holds them in one
list sorted by stamp: adding a key costs a binary search and a C memmove, a batch larger
than ``MERGE_BATCH`` is sorted and merged with the run in one C sort instead (a thousand
keys released at once would otherwise cost a memmove of the whole run each).

A key that leaves (evicted, touched, set aside again) leaves its entry behind, dead: a key
is live while ``live`` maps it to that very entry.  Iteration skips dead entries;
``tidy`` drops the dead ones at the front (those of the keys the last walk evicted, each
dropped once), and the run is rebuilt from the live entries once the dead outnumber the
live by ``DEAD_SLACK``, so it never holds more than ``2 * len(self) + DEAD_SLACK``
entries after an add.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from itertools import islice
from operator import itemgetter

from lmcache_tiers.keys import ObjectKey

#: a key waiting, with its stamp; the very tuple ``live`` maps the key to while it waits
StampedKey = tuple[int, ObjectKey]
_STAMP = itemgetter(0)

#: dead entries the run may hold beyond as many as its live ones before it is rebuilt
#: (each entry is dropped once, so that costs O(1) a key)
DEAD_SLACK = 64

#: a batch at least this long is merged with one sort rather than inserted key by key: a
#: sort costs about 50 ns an entry waiting, a binary-search insert a memmove of half the
#: run (about 0.2 ns an entry), so the sort is cheaper from a few hundred keys on
MERGE_BATCH = 256


class StampedKeys:
    """Keys in ascending stamp order; adding, removing and membership by key are cheap."""

    __slots__ = ("_entries", "_start", "live")

    def __init__(self) -> None:
        self.live: dict[ObjectKey, StampedKey] = {}
        self._entries: list[StampedKey] = []
        self._start = 0  # entries before it are dropped

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, key: object) -> bool:
        return key in self.live

    def stored(self) -> int:
        """Entries held, dead ones included (what the memory bound is about)."""
        return len(self._entries) - self._start

    def add(self, key: ObjectKey, stamp: int) -> None:
        """Hold ``key`` with ``stamp`` (a key held already moves to that stamp)."""
        entry = self.live[key] = (stamp, key)
        entries = self._entries
        if len(entries) == self._start or entries[-1][0] < stamp:
            entries.append(entry)  # later than every stamp held: the common case
        else:
            bisect.insort(entries, entry, lo=self._start, key=_STAMP)
        self._bound()

    def add_many(self, pairs: Iterable[tuple[ObjectKey, int]]) -> None:
        """Hold each ``(key, stamp)`` of ``pairs``; a long batch is merged in one sort."""
        batch = [(stamp, key) for key, stamp in pairs]
        if len(batch) < MERGE_BATCH:
            for stamp, key in batch:
                self.add(key, stamp)
            return
        live = self.live
        for entry in batch:
            live[entry[1]] = entry
        # Both runs sorted: Python's sort merges them in linear time.
        merged = self._entries[self._start :]
        merged += batch
        merged.sort(key=_STAMP)
        self._entries, self._start = merged, 0
        self._bound()

    def pop(self, key: ObjectKey) -> int | None:
        """Forget ``key``; its stamp, or None if it was not here."""
        entry = self.live.pop(key, None)
        return None if entry is None else entry[0]

    def tidy(self) -> None:
        """Drop the dead entries at the front (before a walk, so that it starts at a live
        one), or rebuild the run once the dead are too many."""
        if self._bound():
            return
        entries, live, start = self._entries, self.live, self._start
        while start < len(entries) and live.get(entries[start][1]) is not entries[start]:
            start += 1
        if start and 2 * start >= len(entries):
            del entries[:start]  # the dropped slots are half the list: reclaim them
            start = 0
        self._start = start

    def _bound(self) -> bool:
        """Rebuild the run from the live entries if the dead outnumber them by more than
        ``DEAD_SLACK``; whether it did."""
        if self.stored() <= 2 * len(self.live) + DEAD_SLACK:
            return False
        self._entries = sorted(self.live.values(), key=_STAMP)
        self._start = 0
        return True

    def entries(self) -> Iterator[StampedKey]:
        """The live ``(stamp, key)`` entries, by stamp."""
        live = self.live
        for entry in islice(self._entries, self._start, None):
            if live.get(entry[1]) is entry:
                yield entry

    def keys(self) -> Iterator[ObjectKey]:
        """The live keys, by stamp."""
        for entry in self.entries():
            yield entry[1]
