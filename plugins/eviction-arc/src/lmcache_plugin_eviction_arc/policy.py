"""The ``ARC`` eviction policy.

ARC (Megiddo and Modha, FAST 2003) keeps two LRU lists of live keys -- ``recent`` (seen
once since it became present) and ``frequent`` (seen again) -- and two ghost lists of keys
recently evicted from each.  A key that comes back while its ghost is remembered shows
which list was too small, and the target size of ``recent`` (``_target``) moves towards
it.  The cache size ARC adapts against is the number of live keys: the policy is told
about objects, not bytes, and the caller decides how much to free.

Departures forced by the policy interface:

* ARC evicts one key per miss and inserts the missed key into ``recent`` right after, so
  its list sizes move while it frees room.  ``victims()`` replays that: each victim stands
  for one key about to be written, which keeps ``recent`` at its size when a victim comes
  from it and grows it by one when a victim comes from ``frequent``.
* Only keys this policy offered as victims and that were then removed become ghosts; a
  key deleted for another reason (a temporary prefetch freed after its read, a store
  policy dropping L1 copies) says nothing about the split.  The removals a walk of
  ``victims()`` causes come in the first removal report after it, so that report ends
  the walk: a key the walk passed over (locked, or not yet stored in L2) and removed
  later was not evicted.  A walk that evicts nothing is ended by an empty report.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

from lmcache_plugin_eviction_arc import ARCConfig
from lmcache_tiers.plugin import ObjectKey


class ARCEvictionPolicy:
    """Adaptive replacement between a recency list and a frequency list."""

    def __init__(self, config: ARCConfig | None = None) -> None:
        self.config = config or ARCConfig()
        # Oldest first in every list (iteration order = eviction order).
        self._recent: OrderedDict[ObjectKey, None] = OrderedDict()
        self._frequent: OrderedDict[ObjectKey, None] = OrderedDict()
        self._recent_ghosts: OrderedDict[ObjectKey, None] = OrderedDict()
        self._frequent_ghosts: OrderedDict[ObjectKey, None] = OrderedDict()
        self._target = 0.0  # ARC's p: how many live keys ``recent`` should hold
        self._offered: set[ObjectKey] = set()

    def _capacity(self) -> int:
        return max(1, len(self._recent) + len(self._frequent))

    # A batch is a prefix (chunk 0 first); handling it back to front leaves the tail older
    # than the head in whichever list it lands, so eviction trims prefixes from their end.

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        recent, frequent = self._recent, self._frequent
        for key in reversed(keys):
            if key in recent:
                del recent[key]
                frequent[key] = None
            elif key in frequent:
                frequent.move_to_end(key)
            elif key in self._recent_ghosts:
                # Evicted from `recent` too early: give `recent` more room.
                ratio = len(self._frequent_ghosts) / len(self._recent_ghosts)
                self._target = min(float(self._capacity()), self._target + max(ratio, 1.0))
                del self._recent_ghosts[key]
                frequent[key] = None
            elif key in self._frequent_ghosts:
                ratio = len(self._recent_ghosts) / len(self._frequent_ghosts)
                self._target = max(0.0, self._target - max(ratio, 1.0))
                del self._frequent_ghosts[key]
                frequent[key] = None
            else:
                recent[key] = None
        self._trim_ghosts()

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        # Every LOOKUP lands here: one dict probe per key in the common case (a key
        # already in `frequent`); a read of an unknown key must not revive it.
        recent, frequent = self._recent, self._frequent
        move_to_end = frequent.move_to_end
        for key in reversed(keys):
            try:
                move_to_end(key)
            except KeyError:
                if key in recent:
                    del recent[key]
                    frequent[key] = None

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        offered = self._offered
        for key in keys:
            evicted = key in offered
            if key in self._recent:
                del self._recent[key]
                if evicted:
                    self._recent_ghosts[key] = None
            elif key in self._frequent:
                del self._frequent[key]
                if evicted:
                    self._frequent_ghosts[key] = None
        offered.clear()  # the walk's evictions are reported: the keys left were passed over
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        # ARC's bounds: |recent| + |recent ghosts| <= c and all four lists <= 2c.
        capacity = self._capacity()
        self._target = min(self._target, float(capacity))
        recent_ghosts, frequent_ghosts = self._recent_ghosts, self._frequent_ghosts
        while recent_ghosts and len(self._recent) + len(recent_ghosts) > capacity:
            recent_ghosts.popitem(last=False)
        total = len(self._recent) + len(self._frequent) + len(recent_ghosts)
        while frequent_ghosts and total + len(frequent_ghosts) > 2 * capacity:
            frequent_ghosts.popitem(last=False)
        while recent_ghosts and total + len(frequent_ghosts) > 2 * capacity:
            recent_ghosts.popitem(last=False)
            total -= 1

    def victims(self) -> Iterator[ObjectKey]:
        offered = self._offered
        offered.clear()
        recent_size = len(self._recent)
        frequent_size = len(self._frequent)
        from_recent = iter(self._recent)
        from_frequent = iter(self._frequent)
        taken_recent = taken_frequent = 0
        target = self._target
        while True:
            # Each victim makes room for one key that will enter `recent`.
            recent_left = taken_recent < recent_size
            frequent_left = taken_frequent < frequent_size
            if recent_left and (recent_size + taken_frequent > target or not frequent_left):
                key = next(from_recent)
                taken_recent += 1
            elif frequent_left:
                key = next(from_frequent)
                taken_frequent += 1
            else:
                return
            offered.add(key)
            yield key

    def __len__(self) -> int:
        return len(self._recent) + len(self._frequent)
