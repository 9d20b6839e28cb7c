"""The ``S3FIFO`` eviction policy.

S3-FIFO (Yang et al., SOSP 2023) uses three FIFO queues: ``small`` for keys that just
became present, ``main`` for keys that proved useful, and ``ghosts``, a queue of keys
recently evicted from ``small``.  Eviction takes from ``small`` while it holds at least its
share of the live keys: a key read since it entered moves to ``main``, any other key is a
victim (and becomes a ghost).  From ``main`` a key with reads left is put back at the head
with one read less; the others are victims.  One walk puts back at most
``MAIN_PASSES_PER_WALK`` keys, then offers the oldest key of ``main`` whatever its reads
(CLOCK's worst case, every key with reads left, would otherwise cost up to
``max_frequency`` passes over all of ``main`` for one victim).  A written key remembered as a ghost enters
``main`` directly.  Reads only count, so a LOOKUP costs one dict update per key.

``small`` is kept at its share as keys are written, not only when room is needed: the
oldest keys past the share are promoted then if they were read, or else wait in ``_due``,
the front of ``small`` whose fate is already decided (the next small victims, in order).
A read of a waiting key promotes it at once, as eviction would have on reaching it.  So
an eviction call never walks a ``small`` that grew to the whole cache (with every key read
that walk promoted 1M keys, 1-2 s under the L1 lock).  Promoting then rather than when room
is needed is not the same order of victims: a promoted key enters ``main`` earlier (ahead
of keys that reach it later, ghosts among them), and its reads after the promotion count
there, where a key still in ``small`` would have lost them at its promotion.  On the
shared Mooncake trace the miss ratio moved by under 0.01 (docs/replay.md).

``victims()`` performs those moves as it goes, exactly as the algorithm would while
looking for room; a victim it yields leaves the queues for ``_offered`` until it is
removed.  A victim the caller skipped (a locked object) stays there and is offered first
next time; a read takes it back to ``main``.

Locked victims L1 passed over are set aside (``set_aside``) until their locks end
(``put_back``), so a full L1 whose first victims are read-locked is not walked past them on
every write that evicts.  A key set aside was one of ``_offered``, where the algorithm
has already judged it (a victim, from ``small`` or ``main``); it keeps that judgement and
its place among the victims: put back, it returns among them where its offer put it (each
offer takes a stamp; walks yield the victims offered and those put back merged by stamp),
not to a queue, which would give it another pass it never earned.  The keys put back wait
in a run per queue sorted by stamp (``StampedKeys``), so a put_back costs a sort of its
own keys and a few merges, not a pass over the thousands that may wait.  Meanwhile it is
what a skipped victim is: a read or rewrite takes it to ``main``, and a removal makes it
a ghost when it was a victim of ``small``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from heapq import merge
from operator import itemgetter
from typing import Literal

from lmcache_plugin_eviction_s3fifo import S3FIFOConfig
from lmcache_tiers.plugin import ObjectKey, StampedKeys

_Queue = Literal["small", "main"]
#: a victim's queue and the stamp of its offer (ascending = offered earlier)
_Offer = tuple[_Queue, int]
_STAMP = itemgetter(0)


#: keys of ``main`` one walk of ``victims()`` may put back for their reads.  Unbounded, a
#: ``main`` whose keys all have reads left is walked until every count is spent (up to
#: ``max_frequency`` passes over all of it, under the L1 lock) before the first victim; past
#: this many, the oldest key of ``main`` is offered whatever its count.  The queue's order is
#: kept between walks, so the next walk goes on where this one stopped.  A walk must not
#: end early instead: core takes a walk that ends for "nothing else to evict", failing the
#: write that needed room or evicting objects not yet stored in L2.
MAIN_PASSES_PER_WALK = 4096


class S3FIFOEvictionPolicy:
    """Small, main and ghost FIFO queues with a small read counter per key."""

    def __init__(self, config: S3FIFOConfig | None = None) -> None:
        self.config = config or S3FIFOConfig()
        self._small_fraction = self.config.small_queue_fraction
        self._max_frequency = self.config.max_frequency
        # Oldest first in every queue (iteration order = eviction order).
        self._small: OrderedDict[ObjectKey, None] = OrderedDict()
        self._due: OrderedDict[ObjectKey, None] = OrderedDict()  # front of small, all unread
        self._main: OrderedDict[ObjectKey, None] = OrderedDict()
        self._ghosts: OrderedDict[ObjectKey, None] = OrderedDict()
        self._frequency: dict[ObjectKey, int] = {}  # every live key
        self._offered: OrderedDict[ObjectKey, _Offer] = OrderedDict()  # yielded, still live
        self._aside: dict[ObjectKey, _Offer] = {}  # offered, locked: out of walks
        # offered, set aside, put back: a run by the queue they were victims of
        self._returned_small = StampedKeys()
        self._returned_main = StampedKeys()
        self._returned: dict[_Queue, StampedKeys] = {
            "small": self._returned_small,
            "main": self._returned_main,
        }
        self._next_stamp = 0

    def __len__(self) -> int:
        return len(self._frequency)

    # A batch is a prefix (chunk 0 first); queueing it back to front puts the tail nearer
    # the exit than the head, so eviction trims prefixes from their end.

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        frequency = self._frequency
        skipped = self._victims_skipped()
        for key in reversed(keys):
            if key in frequency:
                self._count_read(key, skipped)  # a rewrite of a live key is another use of it
            elif key in self._ghosts:
                del self._ghosts[key]
                frequency[key] = 0
                self._main[key] = None
            else:
                frequency[key] = 0
                self._small[key] = None
        self._keep_small_at_its_share()

    def _keep_small_at_its_share(self) -> None:
        # Amortised: each written key pushes at most one key past the share, each removed
        # key a tenth of one, so this costs at most the size of the batch reported.
        small, main, due, frequency = self._small, self._main, self._due, self._frequency
        share = self._small_fraction * len(frequency)
        while len(small) > share:
            key, _ = small.popitem(last=False)
            if frequency[key] > 0:
                frequency[key] = 0  # promoted: its reads bought the move
                main[key] = None
            else:
                due[key] = None

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        frequency = self._frequency
        skipped = self._victims_skipped()
        # Back to front, as writes: keys the read takes to ``main`` (waiting in ``_due``,
        # or victims skipped) enter it tail first, so its tail still goes before its head.
        for key in reversed(keys):
            if key in frequency:
                self._count_read(key, skipped)

    def _victims_skipped(self) -> bool:
        """Whether any victim is set aside or put back: asked once per batch, as each ask
        of a run's size is a Python call, which per key doubled the cost of a LOOKUP."""
        return bool(self._aside or self._returned_small or self._returned_main)

    def _count_read(self, key: ObjectKey, skipped: bool) -> None:
        """Count a use of live ``key``; ``skipped``: whether victims set aside or put back
        may be among the keys (``_victims_skipped`` at the start of the batch)."""
        count = self._frequency[key]
        if count < self._max_frequency:
            self._frequency[key] = count + 1
        if key in self._offered:
            # Chosen as a victim but not evicted (it was locked), and now in use again.
            del self._offered[key]
            self._main[key] = None
        elif key in self._due:
            # Past small's share already: eviction would promote it on reaching it.
            del self._due[key]
            self._frequency[key] = 0
            self._main[key] = None
        elif skipped and (self._aside.pop(key, None) is not None or self._take_returned(key) is not None):
            # As a victim skipped: one set aside while locked, or put back since.  Checked
            # last, and only while there are any: a LOOKUP costs one probe per key.
            self._main[key] = None

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        frequency, ghosts = self._frequency, self._ghosts
        for key in keys:
            if frequency.pop(key, None) is None:
                continue
            if key in self._small:
                del self._small[key]
            elif key in self._main:
                del self._main[key]
            elif key in self._due:
                del self._due[key]
            elif self._victims_offer(key)[0] == "small":
                ghosts[key] = None  # evicted from `small`: remember it came by once
        limit = max(1, len(frequency))
        while len(ghosts) > limit:
            ghosts.popitem(last=False)
        self._keep_small_at_its_share()

    def _victims_offer(self, key: ObjectKey) -> _Offer:
        """Forget ``key``, a victim offered (waiting, set aside or put back): its offer."""
        offer = self._offered.pop(key, None) or self._aside.pop(key, None) or self._take_returned(key)
        assert offer is not None, "a live key in no queue"
        return offer

    def _take_returned(self, key: ObjectKey) -> _Offer | None:
        """Forget ``key`` as a victim put back: its offer, or None if it was not one."""
        for queue, run in self._returned.items():
            stamp = run.pop(key)
            if stamp is not None:
                return queue, stamp
        return None

    def _offer(self, key: ObjectKey, queue: _Queue) -> None:
        self._offered[key] = (queue, self._next_stamp)
        self._next_stamp += 1

    def set_aside(self, keys: Sequence[ObjectKey]) -> None:
        """Leave ``keys`` (victims L1 found locked) out of walks until ``put_back``; keys
        not among the victims offered (removed, read since, set aside already) are
        ignored."""
        offered, aside = self._offered, self._aside
        for key in keys:
            offer = offered.pop(key, None) or self._take_returned(key)
            if offer is not None:
                aside[key] = offer

    def put_back(self, keys: Sequence[ObjectKey]) -> None:
        """Offer ``keys`` (no longer locked) again, among the victims in the order they
        were first offered (see the module docstring); keys not set aside are ignored."""
        aside = self._aside
        back: dict[_Queue, list[tuple[ObjectKey, int]]] = {"small": [], "main": []}
        for key in keys:
            offer = aside.pop(key, None)
            if offer is not None:
                back[offer[0]].append((key, offer[1]))
        for queue, run in self._returned.items():
            run.add_many(back[queue])

    def _victims_waiting(self) -> Iterator[ObjectKey]:
        """The victims offered before and not evicted, put back ones among them, in the
        order they were first offered."""
        offered = self._offered
        returned = [run for run in self._returned.values() if run]
        if not returned:
            for key in list(offered):
                if key in offered:
                    yield key
            return
        for run in returned:
            run.tidy()
        waiting = [(offer[1], key) for key, offer in offered.items()]
        runs = (run.entries() for run in returned)
        for entry in merge(waiting, *runs, key=_STAMP):  # lazily: a walk stops early
            yield entry[1]

    def victims(self) -> Iterator[ObjectKey]:
        # Victims offered earlier and skipped are still the first choice.
        yield from self._victims_waiting()
        small, due, main, frequency = self._small, self._due, self._main, self._frequency
        passes_left = MAIN_PASSES_PER_WALK
        while small or due or main:
            live = len(frequency)
            in_small = len(due) + len(small)
            if in_small and (not main or in_small >= self._small_fraction * live):
                if due:
                    key, _ = due.popitem(last=False)  # unread: reads promote waiting keys
                    self._offer(key, "small")
                    yield key
                    continue
                key, _ = small.popitem(last=False)
                if frequency[key] > 0:
                    frequency[key] = 0  # promoted: its reads bought the move
                    main[key] = None
                    continue
                self._offer(key, "small")
            else:
                key, _ = main.popitem(last=False)
                if frequency[key] > 0 and passes_left > 0:
                    passes_left -= 1
                    frequency[key] -= 1
                    main[key] = None
                    continue
                self._offer(key, "main")
            yield key
