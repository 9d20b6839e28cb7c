"""The ``LRU`` eviction policy."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from heapq import merge
from itertools import chain

from lmcache_plugin_eviction_lru import LRUConfig
from lmcache_tiers.plugin import ObjectKey

#: a key put back, with the stamp it was set aside with; the very tuple the key maps to in
#: ``_returned`` while it waits there (a key put back twice has two, one of them dead)
_Entry = tuple[int, ObjectKey]

#: dead entries the runs of keys put back may hold beyond as many as the live ones before
#: they are all dropped at once (a sort of the live ones, paid for by the dead ones' keys)
_DEAD_SLACK = 64


class LRUEvictionPolicy:
    """Least recently used first; the oldest key sits at the front of the order.

    Keys L1 found locked when a walk reached them are set aside (``set_aside``) until their
    locks end (``put_back``): a full L1 whose oldest objects are read-locked would
    otherwise be walked past every one of them on every write that evicts.  A key set
    aside was at the front when the walk passed it, so it is older than every key left in
    the order and every key touched since (those go to the back): put back, it goes
    before them all, among the keys put back in the order they were set aside in (each
    keeps the stamp it was first set aside with).  A read or write of a key set aside
    makes it the most recent, as for any key.

    Keys come back a few at a time, in any order, while tens of thousands may wait to be
    evicted (under the L1 lock): each ``put_back`` sorts only its own keys into a run, and
    the runs are merged like a binary counter (a run merges with the one before it once
    that is at most twice as long, so there are at most log2 of them and each key is
    merged that many times, by C sorts of two sorted runs); a walk merges the runs lazily.
    Keys leaving the runs (evicted, read, written, set aside again) leave dead entries
    behind, skipped by walks: those at a run's old end (the keys walks evicted) are dropped
    before the next walk, and all of them once they outnumber the live ones.
    """

    def __init__(self, config: LRUConfig | None = None) -> None:
        self.config = config or LRUConfig()
        self._order: OrderedDict[ObjectKey, None] = OrderedDict()
        # The keys of the last read, when every one was moved and nothing changed the
        # order since: reading them again would move them to where they already are.
        self._last_read: list[ObjectKey] | None = None
        # Keys out of ``_order``, each with its stamp (ascending = oldest first): locked
        # ones left out of walks, and those put back, offered before ``_order``.
        self._aside: dict[ObjectKey, int] = {}
        self._next_stamp = 0
        # The keys put back, each with its live entry, and the entries in runs, each
        # sorted newest first, the longest run first (see the class docstring);
        # ``_entries`` counts the runs'.
        self._returned: dict[ObjectKey, _Entry] = {}
        self._runs: list[list[_Entry]] = []
        self._entries = 0

    # A batch is a prefix (chunk 0 first).  Touching it back to front leaves the tail
    # older than the head, so eviction trims a prefix from its end and the chunks that
    # remain are still a prefix an engine can use.

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        self._last_read = None
        order = self._order
        if self._aside or self._returned:
            self._forget_out_of_order(keys)
        for key in reversed(keys):
            order[key] = None
            order.move_to_end(key)

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        # A read of a key this policy does not hold (already removed) must not revive it.
        # Every LOOKUP lands here, with keys L1 holds: all of them are moved in one C-level
        # pass; move_to_end raises for a key not held, and then the batch is moved again
        # key by key, skipping those (the same moves in the same order: the same order).
        # An engine asks about one waiting prompt again and again: the same reads in a row
        # leave the order as the first one did (a list comparison, by identity first).
        if self._last_read is not None and keys == self._last_read:
            return
        order = self._order
        move_to_end = order.move_to_end
        try:
            deque(map(move_to_end, reversed(keys)), 0)
            self._last_read = list(keys)
            return
        except KeyError:
            self._last_read = None
        aside, returned = self._aside, self._returned
        for key in reversed(keys):
            try:
                move_to_end(key)
            except KeyError:
                # A key out of the order (set aside or put back) read: the most recent now.
                if aside.pop(key, None) is not None or returned.pop(key, None) is not None:
                    order[key] = None

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        self._last_read = None
        for key in keys:
            self._order.pop(key, None)
        if self._aside or self._returned:
            self._forget_out_of_order(keys)

    def _forget_out_of_order(self, keys: Sequence[ObjectKey]) -> None:
        aside, returned = self._aside, self._returned
        for key in keys:
            aside.pop(key, None)
            returned.pop(key, None)

    def set_aside(self, keys: Sequence[ObjectKey]) -> None:
        """Leave ``keys`` (locked: L1 passed them over, in walk order) out of walks until
        ``put_back``; keys not offered by walks are ignored."""
        self._last_read = None
        order, aside, returned = self._order, self._aside, self._returned
        for key in keys:
            entry = returned.pop(key, None)
            if entry is not None:
                stamp = entry[0]
            elif key in order:
                del order[key]
                stamp = self._next_stamp
                self._next_stamp += 1
            else:  # removed, or set aside already
                continue
            aside[key] = stamp

    def put_back(self, keys: Sequence[ObjectKey]) -> None:
        """Offer ``keys`` (no longer locked) again, ahead of the order (see the class
        docstring); keys not set aside are ignored.  Costs its own keys (a sort of them)
        and, amortized, a few merges of each."""
        self._last_read = None
        aside, returned = self._aside, self._returned
        run = [(aside.pop(key), key) for key in keys if key in aside]
        if not run:
            return
        # Newest first, so that the oldest, which walks take, leave a run from its end.
        run.sort(reverse=True)  # by stamp: no two keys share one, so keys are never compared
        for entry in run:
            returned[entry[1]] = entry
        runs = self._runs
        runs.append(run)
        self._entries += len(run)
        while len(runs) > 1 and len(runs[-2]) <= 2 * len(runs[-1]):
            last = runs.pop()
            runs[-1] += last
            runs[-1].sort(reverse=True)  # two sorted runs: one linear merge in C

    def _returned_in_order(self) -> Iterator[ObjectKey]:
        """The keys put back, by stamp (their live entries, the runs merged)."""
        returned, runs = self._returned, self._runs
        for entry in reversed(runs[0]) if len(runs) == 1 else merge(*map(reversed, runs)):
            if returned.get(entry[1]) is entry:
                yield entry[1]

    def _drop_dead_entries(self) -> None:
        """Before a walk: drop the dead entries at the old end of each run (those of the
        keys the last walks evicted, each dropped once), so that a walk starts at a live
        one; and all of them once they outnumber the live ones (plus a slack)."""
        returned, runs = self._returned, self._runs
        if self._entries > 2 * len(returned) + _DEAD_SLACK:
            live = sorted(returned.values(), reverse=True)
            self._runs = [live] if live else []
            self._entries = len(live)
            return
        for run in runs:
            while run and returned.get(run[-1][1]) is not run[-1]:
                run.pop()
                self._entries -= 1
        if not all(runs):
            runs[:] = [run for run in runs if run]

    def victims(self) -> Iterator[ObjectKey]:
        if self._runs:
            self._drop_dead_entries()
        if self._returned:
            return chain(self._returned_in_order(), self._order)
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order) + len(self._aside) + len(self._returned)
