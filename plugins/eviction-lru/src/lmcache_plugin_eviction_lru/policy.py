"""The ``LRU`` eviction policy."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from itertools import chain

from lmcache_plugin_eviction_lru import LRUConfig
from lmcache_tiers.plugin import ObjectKey, StampedKeys


class LRUEvictionPolicy:
    """Least recently used first; the oldest key sits at the front of the order.

    Keys L1 found locked when a walk reached them are set aside (``set_aside``) until their
    locks end (``put_back``): a full L1 whose oldest objects are read-locked would
    otherwise be walked past every one of them on every write that evicts.  A key set
    aside was at the front when the walk passed it, so it is older than every key left in
    the order and every key touched since (those go to the back): put back, it goes
    before them all, among the keys put back in the order they were set aside in (each
    keeps the stamp it was first set aside with).  One departure: a key L1 passed over
    without setting it aside (not yet stored in L2, or not ready) stays at the front of
    the order, and a key put back goes ahead of it though it is younger.  A read or write
    of a key set aside makes it the most recent, as for any key.

    Keys come back a few at a time, in any order, while tens of thousands may wait to be
    evicted (under the L1 lock): they wait sorted by stamp (``StampedKeys``), so a
    ``put_back`` costs a sort of its own keys and a few merges, not a pass over the keys
    waiting.  Keys leaving them (evicted, read, written, set aside again) leave dead
    entries behind, skipped by walks: those of the keys walks evicted are dropped before
    the next walk, and all of them once they outnumber the live ones.
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
        self._returned = StampedKeys()
        self._next_stamp = 0

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
                if aside.pop(key, None) is not None or returned.pop(key) is not None:
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
            returned.pop(key)

    def set_aside(self, keys: Sequence[ObjectKey]) -> None:
        """Leave ``keys`` (locked: L1 passed them over, in walk order) out of walks until
        ``put_back``; keys not offered by walks are ignored."""
        self._last_read = None
        order, aside, returned = self._order, self._aside, self._returned
        for key in keys:
            stamp = returned.pop(key)  # put back and passed over again: it keeps its stamp
            if stamp is None:
                if key not in order:
                    continue  # removed, or set aside already
                del order[key]
                stamp = self._next_stamp
                self._next_stamp += 1
            aside[key] = stamp

    def put_back(self, keys: Sequence[ObjectKey]) -> None:
        """Offer ``keys`` (no longer locked) again, ahead of the order (see the class
        docstring); keys not set aside are ignored."""
        self._last_read = None
        aside = self._aside
        self._returned.add_many([(key, aside.pop(key)) for key in keys if key in aside])

    def victims(self) -> Iterator[ObjectKey]:
        returned = self._returned
        if returned.stored():
            returned.tidy()
        if returned:
            return chain(returned.keys(), self._order)
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order) + len(self._aside) + len(self._returned)
