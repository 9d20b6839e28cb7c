"""Keys waiting in the order of their stamps, for eviction policies' ``put_back``.

A policy that sets locked keys aside (``EvictionPolicy.set_aside``) gives each a stamp
(ascending = set aside earlier) and, once put back, offers them in stamp order while tens
of thousands may wait and one more comes back each write (under the L1 lock).
``StampedKeys`` sorts only the keys of each batch added into a run, and merges the runs
like a binary counter: a run merges with the one before it once that is at most twice as
long, so there are at most log2 of them and each key is merged that many times, by C
sorts of two sorted runs.  Iteration merges the runs lazily (a walk stops early).  One
list kept sorted would cost a memmove of half of it per key added (10-20 us at 50,000
waiting), and a batch added key by key that much per key.

A key that leaves (evicted, touched, set aside again) leaves its entry behind, dead: a key
is live while ``live`` maps it to that very entry.  Iteration skips dead entries;
``tidy`` drops the dead ones at each run's old end (those of the keys the last walk
evicted, each dropped once), and the runs are rebuilt from the live entries once the dead
outnumber the live by more than ``DEAD_SLACK``, so they never hold more than
``2 * len(self) + DEAD_SLACK`` entries after an add.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from heapq import merge
from operator import itemgetter

from lmcache_tiers.keys import ObjectKey

#: a key waiting, with its stamp; the very tuple ``live`` maps the key to while it waits
StampedKey = tuple[int, ObjectKey]
_STAMP = itemgetter(0)

#: dead entries the runs may hold beyond as many as the live ones before they are rebuilt
#: (a sort of the live ones, paid for by the dead ones' keys)
DEAD_SLACK = 64


class StampedKeys:
    """Keys in ascending stamp order; adding, removing and membership by key are cheap."""

    __slots__ = ("_runs", "_stored", "live")

    def __init__(self) -> None:
        self.live: dict[ObjectKey, StampedKey] = {}
        # Each run sorted newest first, so that the oldest, which walks take, leave it
        # from its end; the longest run first.  ``_stored`` counts their entries.
        self._runs: list[list[StampedKey]] = []
        self._stored = 0

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, key: object) -> bool:
        return key in self.live

    def stored(self) -> int:
        """Entries held, dead ones included (what the memory bound is about)."""
        return self._stored

    def add(self, key: ObjectKey, stamp: int) -> None:
        """Hold ``key`` with ``stamp`` (a key held already moves to that stamp)."""
        self.add_many(((key, stamp),))

    def add_many(self, pairs: Iterable[tuple[ObjectKey, int]]) -> None:
        """Hold each ``(key, stamp)`` of ``pairs``: a sort of them, and a few merges."""
        run = [(stamp, key) for key, stamp in pairs]
        if not run:
            return
        live = self.live
        for entry in run:
            live[entry[1]] = entry
        run.sort(key=_STAMP, reverse=True)
        runs = self._runs
        runs.append(run)
        self._stored += len(run)
        while len(runs) > 1 and len(runs[-2]) <= 2 * len(runs[-1]):
            last = runs.pop()
            runs[-1] += last
            runs[-1].sort(key=_STAMP, reverse=True)  # two sorted runs: one linear merge in C
        self._bound()

    def pop(self, key: ObjectKey) -> int | None:
        """Forget ``key``; its stamp, or None if it was not here."""
        entry = self.live.pop(key, None)
        return None if entry is None else entry[0]

    def tidy(self) -> None:
        """Drop the dead entries at each run's old end (before a walk, so that it starts at
        live ones), or rebuild the runs once the dead are too many."""
        if self._bound():
            return
        live, runs = self.live, self._runs
        for run in runs:
            while run and live.get(run[-1][1]) is not run[-1]:
                run.pop()
                self._stored -= 1
        if not all(runs):
            runs[:] = [run for run in runs if run]

    def _bound(self) -> bool:
        """Rebuild the runs from the live entries if the dead outnumber them by more than
        ``DEAD_SLACK``; whether it did."""
        if self._stored <= 2 * len(self.live) + DEAD_SLACK:
            return False
        run = sorted(self.live.values(), key=_STAMP, reverse=True)
        self._runs = [run] if run else []
        self._stored = len(run)
        return True

    def entries(self) -> Iterator[StampedKey]:
        """The live ``(stamp, key)`` entries, by stamp."""
        live, runs = self.live, self._runs
        merged = reversed(runs[0]) if len(runs) == 1 else merge(*map(reversed, runs), key=_STAMP)
        for entry in merged:
            if live.get(entry[1]) is entry:
                yield entry

    def keys(self) -> Iterator[ObjectKey]:
        """The live keys, by stamp."""
        for entry in self.entries():
            yield entry[1]
