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

Locked keys L1 passed over are set aside (``set_aside``) until their locks end
(``put_back``), so a full L1 whose first victims are read-locked is not walked past them on
every write that evicts.  A key set aside stays a live key of its list, T1 (``recent``) or
T2 (``frequent``): it counts in the list sizes that set the cache size, the ghost bounds
and the split of a walk, only no walk offers it.  A walk passed over it at the front of
its list (everything before it was evicted or set aside too), so put back it returns to
the front of the same list, among the keys put back in the order they were set aside
(each keeps the stamp it was first set aside with): where ARC's own order still has it.
One departure: a key L1 passed over without setting it aside (not yet stored in L2, or
not ready) stays in its list, and a key put back goes ahead of it though it was behind.
The keys put back wait sorted by stamp ahead of their list (``StampedKeys``), so a
put_back costs a sort of its own keys and a few merges, not a pass over the thousands that
may wait.
Returning to T1 rather than T2 matters: being locked is not a second use.  A read or
rewrite meanwhile is one, and moves it to T2's most recent end as for any live key; a
removal forgets it without a ghost (no walk evicted it).
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import chain

from lmcache_plugin_eviction_arc import ARCConfig
from lmcache_tiers.plugin import ObjectKey, StampedKeys


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
        # Keys set aside, by list, each with its stamp (ascending = set aside earlier), and
        # T2's stamps sorted: a walk counts the keys set aside before each key put back.
        self._aside_recent: dict[ObjectKey, int] = {}
        self._aside_frequent: dict[ObjectKey, int] = {}
        self._aside_frequent_stamps: list[int] = []
        # The keys put back and not touched since, ahead of their list.
        self._back_recent = StampedKeys()
        self._back_frequent = StampedKeys()
        self._next_stamp = 0

    # Every write that evicts reads the sizes and this check several times, under the L1
    # lock: the paths it takes (``on_keys_written``, ``_trim_ghosts``, ``victims``) read
    # the lengths themselves, as a call costs more than the reads (``live``: the keys put
    # back, without a call to ``StampedKeys.__len__``).

    def _sizes(self) -> tuple[int, int]:
        """The live keys of T1 and of T2, those set aside or put back included."""
        return (
            len(self._recent) + len(self._back_recent.live) + len(self._aside_recent),
            len(self._frequent) + len(self._back_frequent.live) + len(self._aside_frequent),
        )

    def _capacity(self) -> int:
        return max(1, sum(self._sizes()))

    def _out_of_lists(self) -> bool:
        """Whether any key is set aside or put back (out of ``_recent``/``_frequent``)."""
        return bool(
            self._aside_recent or self._aside_frequent or self._back_recent.live or self._back_frequent.live
        )

    # A batch is a prefix (chunk 0 first); handling it back to front leaves the tail older
    # than the head in whichever list it lands, so eviction trims prefixes from their end.

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        recent, frequent = self._recent, self._frequent
        # ``_out_of_lists()`` (read, not called: see above)
        out_of_lists = bool(
            self._aside_recent or self._aside_frequent or self._back_recent.live or self._back_frequent.live
        )
        for key in reversed(keys):
            if key in recent:
                del recent[key]
                frequent[key] = None
            elif key in frequent:
                frequent.move_to_end(key)
            elif out_of_lists and self._take_out(key) is not None:
                frequent[key] = None  # a second use, as for any live key
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
                elif self._out_of_lists() and self._take_out(key) is not None:
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
            elif self._out_of_lists():
                was = self._take_out(key)  # set aside (no walk offered it: no ghost) or put back
                if evicted and was == "recent":
                    self._recent_ghosts[key] = None
                elif evicted and was == "frequent":
                    self._frequent_ghosts[key] = None
        offered.clear()  # the walk's evictions are reported: the keys left were passed over
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        # ARC's bounds: |recent| + |recent ghosts| <= c and all four lists <= 2c.
        recent_size = len(self._recent) + len(self._back_recent.live) + len(self._aside_recent)
        live = recent_size + len(self._frequent) + len(self._back_frequent.live) + len(self._aside_frequent)
        capacity = live or 1
        if self._target > capacity:
            self._target = float(capacity)
        recent_ghosts, frequent_ghosts = self._recent_ghosts, self._frequent_ghosts
        while recent_ghosts and recent_size + len(recent_ghosts) > capacity:
            recent_ghosts.popitem(last=False)
        total = live + len(recent_ghosts)
        while frequent_ghosts and total + len(frequent_ghosts) > 2 * capacity:
            frequent_ghosts.popitem(last=False)
        while recent_ghosts and total + len(frequent_ghosts) > 2 * capacity:
            recent_ghosts.popitem(last=False)
            total -= 1

    # -- keys set aside while locked (see the module docstring) ------------------------------

    def set_aside(self, keys: Sequence[ObjectKey]) -> None:
        """Leave ``keys`` (locked: L1 passed them over, in walk order) out of walks until
        ``put_back``; keys not in T1 or T2 (removed, set aside already) are ignored."""
        for key in keys:
            if key in self._recent or key in self._back_recent:
                self._aside_recent[key] = self._stamp(key, self._recent, self._back_recent)
            elif key in self._frequent or key in self._back_frequent:
                stamp = self._aside_frequent[key] = self._stamp(key, self._frequent, self._back_frequent)
                bisect.insort(self._aside_frequent_stamps, stamp)

    def _stamp(self, key: ObjectKey, keys: OrderedDict[ObjectKey, None], back: StampedKeys) -> int:
        """Take ``key`` out of its list: the stamp it was put back with, else a new one
        (later than every stamp given, as the walk passed it after them all)."""
        stamp = back.pop(key)
        if stamp is None:
            del keys[key]
            stamp = self._next_stamp
            self._next_stamp += 1
        return stamp

    def put_back(self, keys: Sequence[ObjectKey]) -> None:
        """Offer ``keys`` (no longer locked) again, ahead of their list in the order they
        were set aside; keys not set aside are ignored."""
        aside_recent, aside_frequent = self._aside_recent, self._aside_frequent
        to_recent: list[tuple[ObjectKey, int]] = []
        to_frequent: list[tuple[ObjectKey, int]] = []
        for key in keys:
            stamp = aside_recent.pop(key, None)
            if stamp is not None:
                to_recent.append((key, stamp))
                continue
            stamp = aside_frequent.pop(key, None)
            if stamp is not None:
                to_frequent.append((key, stamp))
        self._back_recent.add_many(to_recent)
        if to_frequent:
            self._back_frequent.add_many(to_frequent)
            self._drop_frequent_stamps([stamp for _, stamp in to_frequent])

    def _take_out(self, key: ObjectKey) -> str | None:
        """Forget ``key`` as set aside or put back (read, rewritten or removed): the list
        it was in (``recent``, ``frequent``), or None."""
        if self._aside_recent.pop(key, None) is not None or self._back_recent.pop(key) is not None:
            return "recent"
        if self._back_frequent.pop(key) is not None:
            return "frequent"
        stamp = self._aside_frequent.pop(key, None)
        if stamp is None:
            return None
        self._drop_frequent_stamps([stamp])
        return "frequent"

    def _drop_frequent_stamps(self, gone: list[int]) -> None:
        stamps = self._aside_frequent_stamps
        if 8 * len(gone) > len(stamps):
            stamps[:] = sorted(self._aside_frequent.values())  # many at once: rebuilt
            return
        for stamp in gone:
            del stamps[bisect.bisect_left(stamps, stamp)]

    # -- the walk ----------------------------------------------------------------------------

    def victims(self) -> Iterator[ObjectKey]:
        # Each victim makes room for one key that will enter `recent`: victims come from
        # `frequent` while `recent` plus them stays within the target (all of `frequent`
        # when `recent` is empty), then all of `recent`, then the rest of `frequent`.  Keys
        # set aside count in the sizes and positions.
        offered = self._offered
        offered.clear()
        recent, frequent = self._recent, self._frequent
        back_recent, back_frequent = self._back_recent, self._back_frequent
        recent_size = len(recent) + len(back_recent.live) + len(self._aside_recent)
        room = self._target - recent_size if recent_size else math.inf
        # A key of T2 is preceded there by the keys set aside before it was put back, and
        # by all of them if it was not put back.
        stamps = self._aside_frequent_stamps
        aside_before_others = len(stamps)
        put_back = back_frequent.live
        held_back = None
        from_frequent = _in_order(back_frequent, frequent)
        for taken, key in enumerate(from_frequent):
            entry = put_back.get(key) if put_back else None
            aside_before = aside_before_others if entry is None else bisect.bisect_left(stamps, entry[0])
            if taken + aside_before > room:
                held_back = key
                break
            offered.add(key)
            yield key
        for key in _in_order(back_recent, recent):
            offered.add(key)
            yield key
        if held_back is not None:
            offered.add(held_back)
            yield held_back
        for key in from_frequent:
            offered.add(key)
            yield key

    def __len__(self) -> int:
        return sum(self._sizes())


def _in_order(back: StampedKeys, keys: OrderedDict[ObjectKey, None]) -> Iterator[ObjectKey]:
    """A list's keys in ARC's order: those put back, then the others.  With none put back
    (nothing locked, the common case) the list itself, with no merge of runs."""
    if not back.stored():
        return iter(keys)
    back.tidy()
    return chain(back.keys(), keys)
