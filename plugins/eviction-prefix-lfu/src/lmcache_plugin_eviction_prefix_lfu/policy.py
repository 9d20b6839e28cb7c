"""The ``PREFIX_LFU`` eviction policy.

What KV-cache traffic looks like to an eviction policy:

* a chunk is only useful while its whole prefix is present, so a prefix must be trimmed
  from its end;
* prompts come back: the same system prompt, document or conversation history is sent
  again and again, at intervals far longer than a small cache's turnover, and a prompt
  sent often is sent sooner again;
* a request's tail is rarely reused: its last chunk ends where the next turn's text
  starts, and the chunks a request stores right after reading a cached prefix are its
  own divergent suffix.

The policy therefore orders chunks by a priority (lowest evicted first)::

    priority = tick of last use + credit * live * log2(uses) - penalty * live (tail only)

``tick`` counts chunks touched (one per chunk of each batch), so ``live`` ticks are one
cache turnover; ``uses`` counts the batches that wrote or read a chunk, and is remembered
for evicted chunks, so a prompt sent again after being evicted comes back with its
standing.  Plain LRU is ``credit = penalty = 0``.  The history holds the counts of the
``max(history_min, history_factor * live)`` chunks evicted last, keyed by the key's hash
(an int, about 180 bytes an entry): a small cache needs a history far longer than itself,
because prompts return after many of its turnovers.

Batches arrive in prefix order.  They are handled back to front, and a chunk's priority is
raised to that of the chunk after it, so a head never ranks below its own tail.  A read
that repeats the previous read exactly (an engine's RETRIEVE of the prefix its LOOKUP just
locked) is not counted again.  A write that directly follows a read is taken as the
extension of the prefix just read.

Priorities are integers; chunks of one priority share a bucket (insertion ordered), and
the sorted list of bucket priorities makes ``victims()`` a plain walk.  A touch costs a few
dict operations, and a bisect when it opens a new bucket.  Dropping the lowest bucket (what
eviction does) retires its slot at the list's front rather than shifting the list, so
evicting from a million single-chunk levels stays O(1) a key.

Locked keys L1 passed over are set aside (``set_aside``) until their locks end
(``put_back``), so a full L1 whose lowest-priority chunks are read-locked is not walked
past them on every write that evicts.  A chunk set aside leaves its bucket but keeps its
priority and use count: being locked is not a use, so put back it returns to the level of
the priority it had, ahead of its bucket (a walk passed over it there: every chunk before
it was evicted or set aside too), among the chunks put back in the order they were set
aside (each keeps the stamp it was first set aside with) -- where the priority order
still has it, but ahead of a chunk of its bucket L1 passed over without setting it aside
(not yet stored in L2, or not ready), which was before it.  The chunks put back wait in
a run per level sorted by stamp (``StampedKeys``), so a put_back costs a sort of its own
chunks and a few merges, not a pass over the bucket; a level is listed while its bucket
or its run holds a chunk.  A read or write meanwhile is a use like any other and re-ranks
it; a removal remembers its use count in the history as for any chunk.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from itertools import islice

from lmcache_plugin_eviction_prefix_lfu import PrefixLFUConfig
from lmcache_tiers.plugin import ObjectKey, StampedKeys

_Signature = tuple[int, ObjectKey, ObjectKey]
#: log2 of small use counts, looked up instead of computed on every touch
_LOG2_SIZE = 1024
_LOG2 = [0.0] + [math.log2(count) for count in range(1, _LOG2_SIZE)]


class PrefixLFUEvictionPolicy:
    """Recency with a logarithmic frequency credit and a tail penalty."""

    def __init__(self, config: PrefixLFUConfig | None = None) -> None:
        self.config = config or PrefixLFUConfig()
        self._credit = self.config.frequency_credit
        self._penalty = self.config.tail_penalty
        self._history_factor = self.config.history_factor
        self._history_min = self.config.history_min
        self._tick = 0
        # live chunk -> [priority, uses]: one lookup finds both on the LOOKUP path
        self._state: dict[ObjectKey, list[int]] = {}
        # evicted chunks by hash(key), oldest first: holding no key object keeps it small
        self._history: OrderedDict[int, int] = OrderedDict()
        self._buckets: dict[int, dict[ObjectKey, None]] = {}
        # Sorted priorities of non-empty buckets from ``_levels_start`` on; the slots before
        # it are retired levels, kept until they are half the list so that dropping the
        # lowest level (every eviction) does not shift the whole list.
        self._levels: list[int] = []
        self._levels_start = 0
        self._last_read: _Signature | None = None
        # Chunks set aside, each with its stamp (ascending = set aside earlier), and those
        # put back and not touched since, at the front of their bucket.
        self._aside: dict[ObjectKey, int] = {}
        self._back: dict[int, StampedKeys] = {}  # by priority, only while non-empty
        self._next_stamp = 0

    def __len__(self) -> int:
        return len(self._state)

    def uses(self, key: ObjectKey) -> int:
        """Uses counted for a live key (0 for a key the policy does not hold)."""
        entry = self._state.get(key)
        return 0 if entry is None else entry[1]

    # -- bookkeeping ---------------------------------------------------------------------

    def _unplace(self, key: ObjectKey) -> int:
        """Forget a live key; returns its use count."""
        priority, uses = self._state.pop(key)
        bucket = self._buckets[priority]
        del bucket[key]
        if not bucket:
            del self._buckets[priority]
            if priority not in self._back:
                self._drop_level(priority)
        return uses

    def _add_level(self, priority: int) -> None:
        levels, start = self._levels, self._levels_start
        if start and (start == len(levels) or priority < levels[start]):
            # Below every live level: reuse the retired slot in front instead of shifting.
            start -= 1
            levels[start] = priority
            self._levels_start = start
        else:
            bisect.insort(levels, priority, start)

    def _drop_level(self, priority: int) -> None:
        levels, start = self._levels, self._levels_start
        index = bisect.bisect_left(levels, priority, start)
        if index != start:
            del levels[index]
            return
        start += 1
        if start * 2 >= len(levels):
            # Retired slots are half the list: reclaim them (amortised O(1) per drop).
            del levels[:start]
            start = 0
        self._levels_start = start

    def _touch(self, keys: Sequence[ObjectKey], tail_from: int, *, known_only: bool = False) -> None:
        """Count one use of each key and re-rank it; keys at ``tail_from`` and after are a
        request's tail.  ``known_only``: skip keys the policy does not hold (reads).

        This runs for every LOOKUP inside the L1 lock, hence the local names and the
        inlined bucket moves: four dict operations per key in the common case.
        """
        state = self._state
        live = max(1, len(state))
        now = self._tick
        credit = self._credit * live
        penalty = int(self._penalty * live)
        history, buckets, back = self._history, self._buckets, self._back
        state_get, log2 = state.get, _LOG2
        floor = -(1 << 62)
        # Neighbouring keys of a prefix usually share their use count, their old bucket
        # and their new one: each is looked up once per run of equal values.
        last_priority, last_bucket = floor, None
        last_old, last_old_bucket = floor, None
        last_count, last_bonus = 0, 0
        touched = 0
        target: dict[ObjectKey, None] | None  # None only between buckets.get and making the bucket
        for position in range(len(keys) - 1, -1, -1):
            key = keys[position]
            entry = state_get(key)
            if entry is None:
                if known_only:
                    continue  # a read of a key already removed must not revive it
                count = (history.pop(hash(key), 0) if history else 0) + 1
            else:
                count = entry[1] + 1
            touched += 1
            if count != last_count:
                last_count = count
                last_bonus = int(credit * (log2[count] if count < _LOG2_SIZE else math.log2(count)))
            priority = now + last_bonus
            if position >= tail_from:
                priority -= penalty
            if priority < floor:
                priority = floor  # the head of a prefix never goes before its tail
            floor = priority
            if entry is not None:
                old = entry[0]
                entry[1] = count
                if old == last_old and last_old_bucket is not None:
                    bucket = last_old_bucket
                else:
                    bucket = buckets[old]
                    last_old, last_old_bucket = old, bucket
                del bucket[key]
                if old == priority:
                    bucket[key] = None  # same bucket: to its end, as a fresh touch
                    continue
                if not bucket:
                    del buckets[old]
                    if old not in back:  # else its run keeps the level
                        self._drop_level(old)
                    last_old, last_old_bucket = floor, None
                entry[0] = priority
            else:
                state[key] = [priority, count]
            if priority == last_priority and last_bucket is not None:
                target = last_bucket
            else:
                target = buckets.get(priority)
                if target is None:
                    target = buckets[priority] = {}
                    if priority not in back:
                        self._add_level(priority)
                last_priority, last_bucket = priority, target
            target[key] = None
        self._tick = now + touched

    # -- the policy protocol ---------------------------------------------------------------

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        if not keys:
            return
        # Right after a read, a write extends the prefix just read: all of it is tail.
        extends_read = self._last_read is not None
        self._last_read = None
        self._unstamp(keys)
        self._touch(keys, 0 if extends_read else len(keys) - 1)

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        if not keys:
            return
        signature = (len(keys), keys[0], keys[-1])
        if signature == self._last_read:
            return  # the RETRIEVE of the prefix a LOOKUP just read
        self._last_read = signature
        self._unstamp(keys)
        self._touch(keys, len(keys), known_only=True)

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        history, state, aside, back = self._history, self._state, self._aside, self._back
        for key in keys:
            if aside and aside.pop(key, None) is not None:
                history[hash(key)] = state.pop(key)[1]  # in no bucket while set aside
            elif back and self._leave_run(key) is not None:
                history[hash(key)] = state.pop(key)[1]
            elif key in state:
                history[hash(key)] = self._unplace(key)
        limit = max(self._history_min, self._history_factor * len(state))
        while len(history) > limit:
            history.popitem(last=False)

    # -- chunks set aside while locked (see the module docstring) -----------------------------

    def set_aside(self, keys: Sequence[ObjectKey]) -> None:
        """Leave ``keys`` (locked: L1 passed them over, in walk order) out of walks until
        ``put_back``; keys not held, or set aside already, are ignored."""
        state, aside, buckets = self._state, self._aside, self._buckets
        for key in keys:
            entry = state.get(key)
            if entry is None or key in aside:
                continue
            stamp = self._leave_run(key) if self._back else None
            if stamp is None:  # in its bucket: the walk passed it after every chunk stamped
                priority = entry[0]
                bucket = buckets[priority]
                del bucket[key]
                if not bucket:
                    del buckets[priority]
                    if priority not in self._back:
                        self._drop_level(priority)
                stamp = self._next_stamp
                self._next_stamp += 1
            aside[key] = stamp

    def put_back(self, keys: Sequence[ObjectKey]) -> None:
        """Offer ``keys`` (no longer locked) again, ahead of the bucket of their priority in
        the order they were set aside; keys not set aside are ignored."""
        aside, state, back = self._aside, self._state, self._back
        by_level: dict[int, list[tuple[ObjectKey, int]]] = {}
        for key in keys:
            stamp = aside.pop(key, None)
            if stamp is not None:
                by_level.setdefault(state[key][0], []).append((key, stamp))
        for priority, chunks in by_level.items():
            run = back.get(priority)
            if run is None:
                run = back[priority] = StampedKeys()
                if priority not in self._buckets:
                    self._add_level(priority)
            run.add_many(chunks)

    def _leave_run(self, key: ObjectKey) -> int | None:
        """Take ``key`` out of the run of chunks put back at its priority: its stamp, or
        None if it is not there.  A level left with no chunk is dropped."""
        entry = self._state.get(key)
        if entry is None:
            return None
        priority = entry[0]
        run = self._back.get(priority)
        stamp = None if run is None else run.pop(key)
        if stamp is not None and not run:
            del self._back[priority]
            if priority not in self._buckets:
                self._drop_level(priority)
        return stamp

    def _unstamp(self, keys: Sequence[ObjectKey]) -> None:
        """Before a touch: chunks set aside or put back return to their bucket (the touch
        moves them on as any chunk)."""
        aside, back = self._aside, self._back
        if not aside and not back:
            return
        state, buckets = self._state, self._buckets
        for key in keys:
            entry = state.get(key)
            if entry is None:
                continue
            priority = entry[0]
            run = None
            if aside.pop(key, None) is None:
                run = back.get(priority)
                if run is None or run.pop(key) is None:
                    continue  # in its bucket already
            bucket = buckets.get(priority)
            if bucket is None:
                bucket = buckets[priority] = {}
                if priority not in back:
                    self._add_level(priority)
            bucket[key] = None
            if run is not None and not run:
                del back[priority]  # its bucket keeps the level

    def victims(self) -> Iterator[ObjectKey]:
        buckets, back = self._buckets, self._back
        for priority in islice(self._levels, self._levels_start, None):
            if back:
                run = back.get(priority)
                if run is not None:
                    run.tidy()  # the dead front dropped, so that the walk starts at a live chunk
                    yield from run.keys()
                bucket = buckets.get(priority)
                if bucket is not None:
                    yield from bucket
            else:
                yield from buckets[priority]
