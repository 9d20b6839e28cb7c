"""The ``LRU`` eviction policy."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence

from lmcache_plugin_eviction_lru import LRUConfig
from lmcache_tiers.plugin import ObjectKey


class LRUEvictionPolicy:
    """Least recently used first; the oldest key sits at the front of the order."""

    def __init__(self, config: LRUConfig | None = None) -> None:
        self.config = config or LRUConfig()
        self._order: OrderedDict[ObjectKey, None] = OrderedDict()
        # The keys of the last read, when every one was moved and nothing changed the
        # order since: reading them again would move them to where they already are.
        self._last_read: list[ObjectKey] | None = None

    # A batch is a prefix (chunk 0 first).  Touching it back to front leaves the tail
    # older than the head, so eviction trims a prefix from its end and the chunks that
    # remain are still a prefix an engine can use.

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        self._last_read = None
        order = self._order
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
        move_to_end = self._order.move_to_end
        try:
            deque(map(move_to_end, reversed(keys)), 0)
            self._last_read = list(keys)
            return
        except KeyError:
            self._last_read = None
        for key in reversed(keys):
            try:
                move_to_end(key)
            except KeyError:
                pass

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        self._last_read = None
        for key in keys:
            self._order.pop(key, None)

    def victims(self) -> Iterator[ObjectKey]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
