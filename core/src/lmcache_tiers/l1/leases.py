"""What keeps an extent from changing hands under a reader: generations and the quarantine.

An object normally gives its extent back to the allocator the moment it leaves L1.  Two
things take an object out from under a holder that has not finished with it:

* a forced delete (``clear(force=True)``) of a read-locked object: the reader still holds
  its lock and may still be copying out of the extent, or holding views into it (an object
  dropped for a disk error of the NVMe L1 leaves the same way, counted as ``dropped``);
* the lock TTL: a reader that kept its lock longer than ``lock_ttl_s`` has it dropped as
  if it had crashed, and a writer slower than ``write_ttl_s`` has its reservation freed.

Either way the extent is **quarantined** instead of freed.  A forced extent stays until
every lock held on it at the time is released, or its lease ends (the latest of the locks'
deadlines, at least the grace period), and not before the grace period of locks that
expired on it earlier ends; an expired one for the grace period (from the last time locks
on it expired: each lock expires at its own deadline).  Only then is it reused.
An object taken away while an L2 store task reads it (``reserve_store``) is quarantined
too, and its extent is also *pinned* until the last such store reports: those locks are
released by identity (``finish_store``) and never reaped, so neither its readers' releases
nor the end of their lease give it back while a store still copies out of it.

Every extent that goes back to the allocator first bumps its **generation**: one counter
per allocation unit, in the table the arena keeps behind the object bytes (clients map it
with the segment).  Any reuse of an extent's bytes needs that extent to go back first, so
a reader that compares the generation it was given with the table after its copy knows
whether the bytes may have changed -- the guarantee that holds even when a lease was
broken and the quarantine did not outlast the reader.

An expired write reservation of a writer that copies into the shared arena itself (a
client of the shared-memory data plane: ``L1Manager.fence_writers``) is **fenced**
instead: its writer may have checked the generation just before stalling and may still
write into the extent at any moment, and no lease can bound a stalled process.  A fenced
extent has no lease end: it goes back only when its writer proves it has stopped copying
(``writers_done``: its commit or abort of the key, which it sends after its copy), so a
late write lands in bytes no other object owns.  Bounding what a writer that never comes
back keeps fenced is its front end's job.

Releases arrive by key.  When a key was stored again while its old extent is still
quarantined, a release of that key is credited to the quarantined extent first: locks on
the old object were taken before the new object existed, and locks are mostly released
in the order they were taken.  The L1 manager's lock guards this class.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1.allocator import ExtentAllocator
from lmcache_tiers.l1.objects import L1Object, ObjectState

logger = logging.getLogger(__name__)

#: ``lapsed_unlocked`` walks at most this many lapsed extents: it runs under the L1 lock
#: for every write that finds L1 full, and after a crashed client's 100k locks lapsed a
#: walk of them all took ~16 ms each time for the whole grace period.  Past it, objects in
#: their grace period count as reclaimable, as if evicting them freed room now: a write no
#: eviction can fit may then evict before it fails (``l1_write_oom``) rather than be
#: refused up front (``l1_write_cannot_fit``) -- a cost, never a wrong byte.
LAPSED_WALK_LIMIT = 1024

#: generation table entries are uint64
_GENERATION_MASK = (1 << 64) - 1

#: why read-locked objects left L1: a forced delete (a client's CLEAR), or a disk error of
#: the NVMe L1 (its caller counts and logs those itself)
TakenBy = Literal["forced", "dropped"]


@dataclass(slots=True, eq=False)
class _Held:
    obj: L1Object
    holders: int  # locks still held on the extent; 0 for an expired one
    until: float  # monotonic time at which it is reclaimed whatever its holders do
    extent_bytes: int
    #: end of the grace period of locks on it that expired earlier: its holders' releases
    #: do not give it back before then, a reaped reader may still be reading it
    not_before: float = 0.0


class LeaseStats(NamedTuple):
    """What is held back now, and what has been held back and reclaimed since start-up."""

    quarantined_extents: int
    quarantined_bytes: int
    lapsed_objects: int  # objects whose read locks expired; their extent is held if they leave
    quarantined_forced: int  # extents of read-locked (or being stored) objects deleted by force
    quarantined_dropped: int  # extents of such objects dropped for an NVMe L1 disk error
    quarantined_expired: int  # extents of expired locks (reads or unfinished writes)
    reclaimed_released: int  # quarantined extents freed once their holders released them
    reclaimed_lease_end: int  # quarantined extents freed at the end of their lease
    reclaimed_bytes: int
    fenced_extents: int  # expired write reservations held until their writers prove done
    fenced_bytes: int
    quarantined_fenced: int  # write reservations that expired while fenced, since start-up
    reclaimed_writer_done: int  # fenced extents given back once their writers proved done


class ExtentLeases:
    """Generations of the allocator's extents, and the extents held back from it."""

    def __init__(self, allocator: ExtentAllocator, generations: memoryview | None, grace_s: float) -> None:
        self._allocator = allocator
        self._block = allocator.align
        self._generations = generations
        self.grace_s = grace_s
        self._by_offset: dict[int, _Held] = {}
        # quarantined extents that still have holders, per key, oldest first
        self._held: dict[ObjectKey, list[_Held]] = {}
        # extent offset -> end of the grace period of an object whose locks expired, in
        # the order those end (``lapse`` re-inserts), so that ``reclaim`` prunes from the
        # front: after a crashed client's 100k locks expired, rebuilding it on every reap
        # held the L1 lock ~18 ms per pass for the whole grace period
        self._lapsed: dict[int, float] = {}
        # the object of each extent in ``_lapsed``: one still in L1 and unlocked frees
        # nothing if evicted before its grace period ends (``lapsed_unlocked``)
        self._lapsed_objects: dict[int, L1Object] = {}
        # (until, offset) of every quarantined extent but the fenced, the earliest first, so
        # that ``reclaim`` looks at those due, not at every quarantined extent (1.2 ms with
        # 100k after a forced clear, on every reap pass).  An extent given back since, or
        # whose ``until`` moved (pushed again then), is passed over when it comes up: one
        # look each, paid for by the hold that pushed it.  Numbers only, which the garbage
        # collector stops tracking: 100k quarantined at once brought full collections.
        self._ends: list[tuple[float, int]] = []
        # Extents held with no ``_Held`` record, by offset: those held for the grace period
        # of expired locks alone (no reader left on them, no store reading them) and the
        # fenced, their end in the object's ``held_until`` (inf: none).  The bulk of a mass
        # expiry: each is kept as its object (tracked by the garbage collector already, and
        # long-lived), so that holding one allocates nothing the collector keeps tracking:
        # a record each made 100k write reservations past their TTL pile up survivors that
        # brought full collections of 40-130 ms into the reap passes.
        self._bare: dict[int, L1Object] = {}
        self.quarantined_bytes = 0
        self.fenced_bytes = 0
        self._fenced = 0
        # One line per burst: a mass expiry is reaped, and its leases end, over a few
        # hundred bounded passes, and a line each flooded the log (the counts are exact).
        self._burst_log = BurstLog(logger)
        self._counts = dict.fromkeys(
            ("forced", "dropped", "expired", "fenced", "released", "lease_end", "writer_done", "bytes"), 0
        )

    # -- extents leaving -------------------------------------------------------------------

    def lapse(self, obj: L1Object, now: float) -> None:
        """Locks on ``obj`` expired (all of them, or some while others are still held): if
        it leaves L1 within the grace period, hold its extent.  ``now`` never goes back
        between calls (the reap's monotonic clock)."""
        lapsed = self._lapsed
        lapsed.pop(obj.offset, None)
        lapsed[obj.offset] = now + self.grace_s
        self._lapsed_objects[obj.offset] = obj

    def release_extents(self, objs: Sequence[L1Object], now: float, taken_by: TakenBy = "forced") -> None:
        """Objects that left L1: free their extents, or quarantine those someone may still
        be reading (read-locked ones, which ``taken_by`` took away; lapsed ones)."""
        free: list[int] = []
        taken = pinned = fenced = 0
        for obj in objs:
            lapsed_until = 0.0
            if self._lapsed:
                lapsed_until = self._lapsed.pop(obj.offset, 0.0)
                self._lapsed_objects.pop(obj.offset, None)
            if obj.fenced and obj.state is ObjectState.WRITING:
                # Left uncommitted (reaped at the write TTL) by a writer that copies into
                # the arena itself and has not said it stopped: it may still be copying.
                self._hold_bare(obj, None)
                fenced += 1
                continue
            # A store's locks are not a reader's: they go by identity (``store_done``).
            # Counting them as holders would let a reader's release of the key be credited
            # to a later object of the key instead of this extent.
            readers = obj.read_locks - obj.storing
            if readers > 0:
                # Only a forced delete or a disk error takes a read-locked object away: its
                # readers keep the extent for the rest of their lease, and at least the
                # grace period.
                until = max(obj.lock_deadline, lapsed_until, now + self.grace_s)
                self._hold(obj, readers, until, not_before=lapsed_until)
                taken += 1
            elif lapsed_until > now:
                if obj.storing:
                    self._hold(obj, 0, lapsed_until)  # and pinned at its lease end
                else:
                    self._hold_bare(obj, lapsed_until)
                self._counts["expired"] += 1
            elif obj.storing:
                self._hold(obj, 0, now)  # pinned only: goes back when its store reports
                pinned += 1
            else:
                free.append(obj.offset)
        # Held back for an L2 store is held back all the same: its return is counted as
        # reclaimed, so its hold is counted here, or the two would never balance.
        self._counts[taken_by] += taken + pinned
        if taken and taken_by == "forced":
            logger.warning(
                "%d read-locked L1 objects deleted by force; their extents are held until their "
                "readers release them (at most until their lock TTL ends)",
                taken,
            )
        if fenced:
            self._counts["fenced"] += fenced
            self._burst_log.warn(
                "fenced",
                "%d expired write reservations fenced: their writers may still be copying into "
                "them, so their extents are not reused until those writers commit or abort "
                "(%d bytes fenced in all)",
                fenced,
                self.fenced_bytes,
                count=fenced,
            )
        if pinned:
            logger.info(
                "%d L1 objects an L2 store is reading were taken out of L1 (%s); their extents "
                "are held until that store reports",
                pinned,
                taken_by,
            )
        self._give_back(free)

    def _hold(self, obj: L1Object, holders: int, until: float, *, not_before: float = 0.0) -> None:
        entry = _Held(obj, holders, until, self._allocator.size_at(obj.offset), not_before)
        self._by_offset[obj.offset] = entry
        self.quarantined_bytes += entry.extent_bytes
        if holders:
            self._held.setdefault(obj.key, []).append(entry)
        self._end_at(entry, until)

    def _hold_bare(self, obj: L1Object, until: float | None) -> None:
        """Hold ``obj``'s extent, with no record, until ``until``, the end of its expired
        locks' grace period; a fenced one (None) until ``writers_done`` names it.  Nothing
        else gives it back."""
        self._bare[obj.offset] = obj
        self.quarantined_bytes += obj.extent_bytes
        if until is None:
            obj.held_until = math.inf
            self.fenced_bytes += obj.extent_bytes
            self._fenced += 1
            return
        obj.held_until = until
        heapq.heappush(self._ends, (until, obj.offset))

    def _end_at(self, entry: _Held, until: float) -> None:
        """``entry`` is reclaimed at ``until``."""
        entry.until = until
        heapq.heappush(self._ends, (until, entry.obj.offset))

    def _give_back(self, offsets: list[int]) -> None:
        # The generation moves before the allocator can hand the extent out again.
        if not offsets:
            return
        generations, block = self._generations, self._block
        if generations is not None:
            for offset in offsets:
                # Wraps at 2**64: a client can write the shared table, and an entry it set
                # to the largest value must not make this release raise (the extent would
                # never go back); any change is what a reader compares.
                index = offset // block
                generations[index] = (generations[index] + 1) & _GENERATION_MASK
        self._allocator.free_many(offsets)

    # -- holders returning -----------------------------------------------------------------

    def has_holders(self, key: ObjectKey) -> bool:
        return key in self._held

    @property
    def any_holders(self) -> bool:
        """Whether any quarantined extent still has readers (rarely: only after a forced
        delete of read-locked objects)."""
        return bool(self._held)

    def held_back(self, obj: L1Object, now: float) -> bool:
        """Whether the extent of the unlocked ``obj`` would be quarantined rather than go
        back if it left L1 now (an expired lock's grace period, an L2 store reading it)."""
        return obj.storing > 0 or self._lapsed.get(obj.offset, 0.0) > now

    def lapsed_unlocked(self, now: float) -> list[L1Object]:
        """The unlocked READY objects whose expired locks' grace period has not ended at
        ``now``: evicting one quarantines its extent (``held_back``), which frees nothing
        until then.  Walks the objects whose locks expired within the grace period: none
        unless a holder let its locks lapse (a crashed client); none either past
        :data:`LAPSED_WALK_LIMIT` of them (see there)."""
        if not self._lapsed or len(self._lapsed) > LAPSED_WALK_LIMIT:
            return []
        objects = self._lapsed_objects
        return [
            obj
            for offset, until in self._lapsed.items()
            if until > now and not (obj := objects[offset]).read_locks and obj.state is ObjectState.READY
        ]

    def holds(self, obj: L1Object) -> bool:
        entry = self._by_offset.get(obj.offset)
        if entry is not None:
            return entry.obj is obj
        return self._bare.get(obj.offset) is obj

    def credit(self, key: ObjectKey, count: int, now: float) -> int:
        """``count`` locks on ``key`` were released: credit them to its quarantined extents,
        oldest first, freeing those left without holders; returns the locks left over."""
        entries = self._held.get(key)
        freed: list[int] = []
        while entries and count:
            entry = entries[0]
            taken = min(count, entry.holders)
            entry.holders -= taken
            count -= taken
            if entry.holders == 0:
                entries.pop(0)
                if entry.obj.storing or entry.not_before > now:
                    # Its readers are done: it goes back when its store reports, and not
                    # before the grace period of the locks that expired on it ends.
                    self._end_at(entry, entry.not_before)
                    continue
                self._forget(entry, "released")
                freed.append(entry.obj.offset)
        if not entries:
            self._held.pop(key, None)
        self._give_back(freed)
        return count

    def store_done(self, obj: L1Object, now: float) -> None:
        """The last L2 store reading ``obj``, which left L1 meanwhile, has reported: its
        extent goes back unless readers or a grace period still hold it."""
        entry = self._by_offset.get(obj.offset)
        if entry is None or entry.obj is not obj or entry.holders or entry.until > now:
            return
        self._forget(entry, "released")
        self._give_back([obj.offset])

    def writers_done(self, objs: Sequence[L1Object]) -> int:
        """The writers of ``objs`` have stopped copying into them (they committed or
        aborted): those fenced go back now; returns how many did."""
        bare = self._bare
        done: list[int] = []
        done_bytes = 0
        for obj in objs:
            offset = obj.offset
            if bare.get(offset) is obj and obj.held_until == math.inf:
                del bare[offset]
                done.append(offset)
                done_bytes += obj.extent_bytes
        if done:
            self.quarantined_bytes -= done_bytes
            self.fenced_bytes -= done_bytes
            self._fenced -= len(done)
            self._counts["writer_done"] += len(done)
            self._counts["bytes"] += done_bytes
        self._give_back(done)
        return len(done)

    def reclaim(self, now: float, budget: int | None = None) -> int:
        """Free quarantined extents whose lease has ended, looking at ``budget`` of them at
        most (all when None); returns how many were freed.  What the budget leaves is due
        at the next call (``reclaim_due``).  Each extent is settled on its own: freed
        (generation moved, then back to the allocator) or still held, never in between."""
        if self._lapsed:
            self._prune_lapsed(now, budget)
        ends, by_offset = self._ends, self._by_offset
        bare = self._bare
        looks = len(ends) if budget is None else budget
        # An entry pushed again at the same end comes up twice: a dict takes it once.
        due: dict[_Held, None] = {}
        lapsed_offsets: list[int] = []  # of the extents held for a grace period alone
        lapsed_bytes = 0
        while ends and ends[0][0] <= now and looks > 0:
            looks -= 1
            until, offset = heapq.heappop(ends)
            entry = by_offset.get(offset)
            if entry is None:
                # Held for a grace period alone, or not held: an end left in the heap by
                # an earlier hold of the extent matches only an end that is due as well.
                held = bare.get(offset)
                if held is not None and held.held_until == until:
                    del bare[offset]
                    lapsed_bytes += held.extent_bytes
                    lapsed_offsets.append(offset)
                continue
            if entry.until != until:
                continue  # given back already, or its lease end moved (pushed again)
            if entry.holders:
                entries = self._held[entry.obj.key]
                entries.remove(entry)
                if not entries:
                    del self._held[entry.obj.key]
                entry.holders = 0
            if entry.obj.storing:
                # Its lease is over: it goes back when its store reports (``store_done``).
                entry.until = 0.0
            else:
                due[entry] = None
        for entry in due:
            self._forget(entry, "lease_end")
        ended = len(due) + len(lapsed_offsets)
        if lapsed_offsets:
            self.quarantined_bytes -= lapsed_bytes
            self._counts["lease_end"] += len(lapsed_offsets)
            self._counts["bytes"] += lapsed_bytes
        if ended:
            self._burst_log.warn(
                "lease_end",
                "%d quarantined L1 extents reclaimed at the end of their lease; a reader still "
                "holding views into them is told that their bytes may have changed",
                ended,
                count=ended,
            )
        self._give_back([entry.obj.offset for entry in due] + lapsed_offsets)
        return ended

    def reclaim_due(self, now: float) -> bool:
        """Whether a :meth:`reclaim` at ``now`` has leases or grace periods to end."""
        if self._ends and self._ends[0][0] <= now:
            return True
        return any(until <= now for until in itertools.islice(self._lapsed.values(), 1))

    def _prune_lapsed(self, now: float, budget: int | None) -> None:
        """Forget the grace periods over by ``now`` (``budget`` of them at most): those at
        the front of ``_lapsed``.  (An entry past its end and left behind a later one, were
        ``now`` ever to go back or the budget to stop short of it, is only kept longer:
        every use compares it with the time.)"""
        lapsed = self._lapsed
        over: list[int] = []
        for offset, until in itertools.islice(lapsed.items(), budget):
            if until > now:
                break
            over.append(offset)
        if len(over) == len(lapsed):
            # A fresh dict: one emptied from the front keeps walking past the slots of
            # the entries taken out, until it grows again.
            self._lapsed = {}
            self._lapsed_objects = {}
            return
        objects = self._lapsed_objects
        for offset in over:
            del lapsed[offset]
            del objects[offset]

    def _forget(self, entry: _Held, how: str) -> None:
        del self._by_offset[entry.obj.offset]
        self.quarantined_bytes -= entry.extent_bytes
        self._counts[how] += 1
        self._counts["bytes"] += entry.extent_bytes

    @property
    def quarantined_extents(self) -> int:
        return len(self._by_offset) + len(self._bare)

    def held_entries(self) -> list[_Held]:
        """Every quarantined extent's record (those held with none are ``held_objects``):
        ``obj.offset`` and ``extent_bytes`` (neither changes while it is held), copied in
        C: read after the L1 lock is let go."""
        return list(self._by_offset.values())

    def held_objects(self) -> list[L1Object]:
        """The objects whose extents are held with no record (for the grace period of their
        expired locks alone, or fenced): ``offset`` and ``extent_bytes`` as in
        ``held_entries``, copied in C."""
        return list(self._bare.values())

    def held_extents(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of every quarantined extent: allocated, and freed by no
        eviction."""
        held = [(offset, entry.extent_bytes) for offset, entry in self._by_offset.items()]
        return held + [(offset, obj.extent_bytes) for offset, obj in self._bare.items()]

    # -- reading ---------------------------------------------------------------------------

    def generations(self, objs: Sequence[L1Object]) -> list[int]:
        """The current generation of each object's extent (0s without a table)."""
        generations, block = self._generations, self._block
        if generations is None:
            return [0] * len(objs)
        return [generations[obj.offset // block] for obj in objs]

    def stats(self) -> LeaseStats:
        counts = self._counts
        return LeaseStats(
            quarantined_extents=self.quarantined_extents,
            quarantined_bytes=self.quarantined_bytes,
            lapsed_objects=len(self._lapsed),
            quarantined_forced=counts["forced"],
            quarantined_dropped=counts["dropped"],
            quarantined_expired=counts["expired"],
            reclaimed_released=counts["released"],
            reclaimed_lease_end=counts["lease_end"],
            reclaimed_bytes=counts["bytes"],
            fenced_extents=self._fenced,
            fenced_bytes=self.fenced_bytes,
            quarantined_fenced=counts["fenced"],
            reclaimed_writer_done=counts["writer_done"],
        )

    def close(self) -> None:
        self._by_offset.clear()
        self._held.clear()
        self._lapsed.clear()
        self._lapsed_objects.clear()
        self._ends.clear()
        self._bare.clear()
        self.quarantined_bytes = 0
        self.fenced_bytes = 0
        self._fenced = 0
        self._generations = None
