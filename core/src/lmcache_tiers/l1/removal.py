"""Objects leaving L1 on request: deletes, eviction passes and the reaping of locks past
their TTL.

Deletes skip objects being written (only ``abort_write`` or the write TTL ends a
reservation, whose writer may be copying into it) and, unless forced, read-locked ones.
Eviction takes unlocked READY objects in the policy's victim order and passes over
unstored ones while the others can free the room.  Whatever leaves while someone may still
read its extent is quarantined rather than freed (``l1/leases.py``).  A clear deletes in
batches, letting go of the lock in between so that a clear of millions of objects does not
hold every other caller up for seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1.allocator import ExtentAllocator
from lmcache_tiers.l1.leases import ExtentLeases
from lmcache_tiers.l1.objects import Eviction, L1Object, ObjectState
from lmcache_tiers.l1.reads import reap_read_locks
from lmcache_tiers.l1.table import ObjectTable
from lmcache_tiers.l1.writes import SkippedWrites

logger = logging.getLogger(__name__)

_READY = ObjectState.READY
_WRITING = ObjectState.WRITING

#: Objects a clear deletes per hold of the L1 lock: about 5 ms of waiting at most for the
#: stores and lookups that come in meanwhile.
CLEAR_BATCH = 1024

#: Objects a TTL reap pass looks at per hold of the L1 lock (1-2 us each, about 1 ms): a client
#: that died holding 100k locks held every store and lookup up for 110-200 ms in one pass.
REAP_BATCH = 512


class Removal:
    """Delete, evict and expire; every method takes the L1 lock."""

    def __init__(
        self,
        lock: threading.RLock,
        table: ObjectTable,
        allocator: ExtentAllocator,
        leases: ExtentLeases,
        skipped: SkippedWrites,
    ) -> None:
        self._lock = lock
        self._table = table
        self._allocator = allocator
        self._leases = leases
        self._skipped = skipped
        self._expired_log = BurstLog(logger)
        #: the last reap pass stopped at its budget with locks still due
        self.reap_backlog = False

    def delete(self, keys: Sequence[ObjectKey], *, force: bool) -> list[bool]:
        with self._lock:
            table = self._table
            done: list[bool] = []
            victims: list[L1Object] = []
            for key in keys:
                obj = table.objects.get(key)
                if obj is None or obj.state is _WRITING or (obj.read_locks and not force):
                    done.append(False)
                    continue
                table.detach(obj)
                victims.append(obj)
                done.append(True)
            table.release_extents(victims)
            table.listeners.notify("deleted", [obj.key for obj in victims])
            return done

    def clear(self, *, force: bool, cleared_unstored: list[L1Object] | None = None) -> int:
        """Delete the objects in L1 when the clear begins, ``CLEAR_BATCH`` at a time with
        the lock let go in between: at about 5 us an object, a million objects under one
        hold kept every store and lookup waiting for seconds.

        What a clear removes is fixed when it begins (by object, not key): objects stored
        meanwhile -- a key cleared and stored again included -- are newer than the clear
        and stay, and so do objects being written when it began, committed or not by the
        time their batch comes (a clear has always left reservations to their writers).
        Each object is judged when its batch comes: read-locked then, it stays unless
        ``force``.  ``cleared_unstored``, when given, receives the objects removed whose
        L2 store had not started (acknowledged writes now in no tier, for the caller to
        count); those an L2 store is reading still reach L2.
        """
        with self._lock:
            snapshot = [obj for obj in self._table.objects.values() if obj.state is not _WRITING]
        return sum(
            self._clear_batch(snapshot[start : start + CLEAR_BATCH], force, cleared_unstored)
            for start in range(0, len(snapshot), CLEAR_BATCH)
        )

    def _clear_batch(
        self, batch: list[L1Object], force: bool, cleared_unstored: list[L1Object] | None
    ) -> int:
        """Delete the objects of ``batch`` still in L1 under one hold of the lock."""
        with self._lock:
            table = self._table
            victims: list[L1Object] = []
            for obj in batch:
                # Gone meanwhile (a close included), or its key holds a newer object: not
                # this clear's to remove.
                if table.objects.get(obj.key) is not obj or (obj.read_locks and not force):
                    continue
                table.detach(obj)
                victims.append(obj)
                if cleared_unstored is not None and obj.unstored and not obj.storing:
                    cleared_unstored.append(obj)
            table.release_extents(victims)
            table.listeners.notify("deleted", [obj.key for obj in victims])
            return len(victims)

    def make_room(
        self,
        bytes_to_free: int,
        victims: Iterable[ObjectKey],
        *,
        spare_unstored: bool,
        passed_locked: list[ObjectKey] | None = None,
        unknown: list[ObjectKey] | None = None,
    ) -> Eviction:
        evicted: list[L1Object] = []
        unstored: list[L1Object] = []
        if bytes_to_free <= 0:
            return Eviction([], [])
        with self._lock:
            table = self._table
            size_at = self._allocator.size_at
            # An extent held back for an expired lock's grace period frees nothing yet: the
            # caller's reservation would fail while other victims could make the room.
            held_back, now = self._leases.held_back, time.monotonic()
            freed = soon = 0  # soon: held back, free once the grace period or store ends
            passed_over: dict[L1Object, None] = {}
            try:
                for key in victims:
                    obj = table.objects.get(key)
                    if obj is None or obj.state is not _READY:
                        if unknown is not None:
                            unknown.append(key)
                        continue
                    if obj.read_locks:
                        if passed_locked is not None:
                            table.set_aside.add(obj)
                            passed_locked.append(key)
                        continue
                    if obj.unstored:
                        passed_over[obj] = None
                        continue
                    table.detach(obj)
                    evicted.append(obj)
                    if held_back(obj, now):
                        soon += size_at(obj.offset)
                    else:
                        freed += size_at(obj.offset)
                    if freed >= bytes_to_free:
                        break
                # Every victim was seen and the room is still short, even counting what is
                # held back for a moment: the last resort, where each one taken is an
                # acknowledged write lost and a refused new write is the lesser harm.
                freed += soon
                if freed < bytes_to_free and not spare_unstored:
                    for obj in passed_over:
                        table.detach(obj)
                        evicted.append(obj)
                        unstored.append(obj)
                        freed += size_at(obj.offset)
                        if freed >= bytes_to_free:
                            break
            finally:
                # The victims iterator may belong to a listener (the eviction policy), so it
                # is told only once iteration is over; detached objects are freed even if
                # the iterator raised.
                table.release_extents(evicted)
                table.listeners.notify("deleted", [obj.key for obj in evicted])
            return Eviction([obj.key for obj in evicted], [obj.key for obj in unstored])

    def take_unlocked_set_aside(self) -> list[ObjectKey]:
        """The keys set aside (``make_room``'s ``passed_locked``) whose objects are no longer
        locked -- their locks ended, or they left L1 -- each once: the caller puts them back
        into its policy's walks before the next one.  Every write that evicts asks it, so it
        costs the objects whose locks ended since the last call, not the keys set aside:
        each unlock moved its object to the table's ``set_aside_ended`` (``end_set_aside``).
        An object locked again since stays set aside, to come back when that lock ends.  A
        key that left L1 was reported removed to the policy already (``put_back`` ignores
        it)."""
        with self._lock:
            table = self._table
            ended = table.set_aside_ended
            if not ended:
                return []
            table.set_aside_ended = []
            objects, set_aside = table.objects, table.set_aside
            keys: list[ObjectKey] = []
            for obj in ended:
                if obj.read_locks and objects.get(obj.key) is obj:
                    set_aside.add(obj)
                else:
                    keys.append(obj.key)
            return keys

    def expire_locks(self, now: float, budget: int = REAP_BATCH) -> int:
        """Reap the locks past their deadline, looking only at the objects filed under the
        deadlines that passed (``l1/deadlines.py``), not at every locked object, and at no
        more than ``budget`` of them: what is left over is due at the next pass
        (``reap_backlog``), and the lock is let go in between.

        Every object looked at is settled within this hold of the lock, so a pass that ends
        at its budget leaves each object either untouched or done with: an expired
        reservation is lapsed and freed (quarantined or fenced by ``release_extents``) in
        the same hold, and one left for the next pass is still WRITING, counted locked and
        its extent still its own, so no one else can be given it; a reader's expired locks
        are dropped, its lapse recorded and, if none is left, the object unlocked (and a
        temporary one freed into quarantine) together, and one left over still has all its
        locks, keeping its extent from eviction and reuse.  ``l1_lock_expired`` counts each
        object when its pass reaps it, so the passes add up to what one pass counted."""
        with self._lock:
            table = self._table
            leases = self._leases
            deadlines = table.deadlines
            # A share of the budget for read cells that ended and stalled objects, as for
            # the leases below: reservations expiring faster than a budget a pass, taken
            # first, would otherwise keep a dead reader's locks (and its objects) from the
            # reap forever.
            reads_wait = deadlines.reads_waiting(now) or deadlines.any_stalled
            read_share = budget // 4 if reads_wait else 0
            expired_writes = deadlines.writes_due(now, budget - read_share)
            for obj in expired_writes:
                leases.lapse(obj, now)
            freed: list[L1Object] = []
            expired_reads = 0
            locked = table.locked
            due_reads = deadlines.reads_due(now, budget - len(expired_writes))
            for obj in due_reads:
                if not obj.read_locks or locked.get(obj.key) is not obj:
                    continue  # unlocked since it was filed, or gone from L1
                if obj.storing:
                    # An L2 store reading the extent is not a client that may have died:
                    # its locks go when it reports (``finish_store``); the others' then.
                    deadlines.stall(obj)
                    continue
                # Each reader's lock goes at its own deadline, however many were taken
                # since: the others' holders keep the object locked.
                reaped = reap_read_locks(obj, now)
                if obj.read_locks:  # a later reap may have emptied the cells of those left
                    deadlines.file_again(obj)
                if not reaped:
                    continue  # filed under a deadline it no longer has locks at
                leases.lapse(obj, now)
                expired_reads += 1
                if obj.read_locks:
                    continue
                del locked[obj.key]
                table.locked_extent_bytes -= obj.extent_bytes
                if obj in table.set_aside:  # its key is due back in eviction walks
                    table.end_set_aside(obj)
                if obj.temporary:
                    freed.append(obj)
            if expired_writes or expired_reads:
                # Reaps come as often as every 0.05 s under short TTLs: one line per burst
                # (``l1_lock_expired`` counts every object).
                self._expired_log.warn(
                    "l1_lock_expired",
                    "L1 lock TTL expired: %d write reservations freed, %d objects' expired read locks "
                    "dropped; their extents are not reused for another %gs",
                    len(expired_writes),
                    expired_reads,
                    leases.grace_s,
                )
            table.free(expired_writes + freed)
            self._skipped.reservations_ended((obj for obj in expired_writes if not obj.loading), "reaped")
            # A share of the budget even when the locks took it all, so that leases end
            # while a long backlog of locks is reaped.
            leases.reclaim(now, max(budget - len(expired_writes) - len(due_reads), budget // 4))
            self.reap_backlog = deadlines.due(now) or leases.reclaim_due(now)
            return len(expired_writes) + expired_reads
