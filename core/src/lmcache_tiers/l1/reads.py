"""Read locks: counted, each with its own deadline, taken on READY objects and dropped by
their readers (or reaped at their TTL, ``l1/removal.py``).

Holders forget a lock at its TTL without releasing it (a late release could drop a lock
someone took since), so a lock must be reaped at its own deadline however often its key is
locked again.  An object keeps its readers' locks per deadline (``L1Object.lock_groups``;
one deadline and no list while they share one, the usual case).  A release does not say
whose locks it drops: when the caller says its locks expire no earlier than
``not_before``, it drops those expiring first from then on (even one that expired a
moment ago, unreaped: the caller saw it live); otherwise those expiring first after now.
Every holder still holding then keeps a lock lasting at least until its own deadline -- at
worst a lock outlives its holder, never the other way round.  Without ``not_before`` a
release may drop a forgotten lock in place of the caller's, which then lives on until its
deadline: callers that know when they took their locks say so.

A deadline is the lock TTL from when the lock was taken rounded up to a grid of
``lock_ttl_s / LOCK_GRID_STEPS`` on the monotonic clock (``read_lock_deadline``), so an
object's locks have at most ``LOCK_GRID_STEPS + 1`` distinct live deadlines however often it
is locked (those it became READY with, ``l1/writes.py``, are on the grid too): a
client locking keys again and again without releasing them costs a count per deadline, not
an entry per lock.  A lock thus lasts up to one grid step longer than its TTL
-- the safe way round.

A temporary object is freed when its last read lock is dropped.  Locks on an extent that
a forced delete quarantined are credited to it before the key's live object
(``l1/leases.py``).  ``lock_prefix`` and ``release`` run on every lookup and retrieve: they
make one pass over the keys, with the table's dicts in locals (and a RETRIEVE's
``lock_prefix`` one more, reading its generations in the same hold of the lock).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Sequence
from operator import attrgetter
from typing import cast

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1.leases import ExtentLeases
from lmcache_tiers.l1.objects import L1Object, ObjectState
from lmcache_tiers.l1.table import ObjectTable, check_lock_count

_READY = ObjectState.READY
_KEY_OF = attrgetter("key")

#: read-lock deadlines are rounded up to multiples of the lock TTL divided by this
LOCK_GRID_STEPS = 64


def read_lock_deadline(now: float, lock_ttl_s: float) -> float:
    """The deadline of a read lock taken at ``now`` (a ``time.monotonic()`` value): ``now``
    plus ``lock_ttl_s``, rounded up to the next multiple of ``lock_ttl_s / LOCK_GRID_STEPS``.

    Monotonic in ``now``, and one float per grid cell: a deadline computed from a time read
    before a lock is taken is never later than the lock's own.
    """
    end = now + lock_ttl_s
    step = lock_ttl_s / LOCK_GRID_STEPS
    if not math.isfinite(step):  # an infinite TTL: nothing to round
        return end
    cell = math.ceil(end / step)
    deadline = cell * step
    # Never short of the TTL, even by a rounding error of the division.
    return deadline if deadline >= end else (cell + 1) * step


class ReadLocks:
    """Taking and dropping read locks; every method takes the L1 lock."""

    def __init__(
        self, lock: threading.RLock, table: ObjectTable, leases: ExtentLeases, *, lock_ttl_s: float
    ) -> None:
        self._lock = lock
        self._table = table
        self._leases = leases
        self.lock_ttl_s = lock_ttl_s
        # (table.ready_version, keys, their objects) of the last lock_prefix that found
        # every key it was given, each once: engines ask about one waiting prompt again and
        # again, and the probe per key is most of what such a lookup costs
        self._last_hit: tuple[int, list[ObjectKey], list[L1Object]] | None = None
        # (first, last, deadline): every ``now`` from first to last has that read-lock
        # deadline (``lock_deadline``); empty until a lookup computes one
        self._deadline_span = (math.inf, -math.inf, 0.0)

    def lock_deadline(self, now: float) -> float:
        """``read_lock_deadline(now, self.lock_ttl_s)``, the very float, rounded afresh once
        per grid cell instead of on every lookup.  It is monotonic in ``now``: equal at two
        times, it is equal at every time between them, so a span whose both ends give the
        deadline holds it throughout.  Safe without the L1 lock too (``L1Manager.lock_deadline``):
        the span is one tuple, read and replaced whole, and every span stored holds its
        deadline, whichever thread stored it last."""
        first, last, deadline = self._deadline_span
        if first <= now <= last:
            return deadline
        ttl = self.lock_ttl_s
        deadline = read_lock_deadline(now, ttl)
        cell_end = deadline - ttl  # NaN for an infinite TTL
        step = ttl / LOCK_GRID_STEPS
        # The cell's end, else a little short of it (a rounding error of the subtraction
        # may put the end in the next cell), else its middle: the first such time after
        # ``now`` that gives the same deadline, so wherever in its cell ``now`` falls, the
        # lookups after it, until near the cell's end, take the deadline as it is.
        for later in (cell_end, cell_end - step / 1024, cell_end - step / 2):
            if later > now and read_lock_deadline(later, ttl) == deadline:
                self._deadline_span = (now, later, deadline)
                break
        return deadline

    def prefix_hits(self, keys: Sequence[ObjectKey]) -> int:
        with self._lock:
            objects = self._table.objects
            hits = 0
            for key in keys:
                obj = objects.get(key)
                if obj is None or obj.state is not _READY:
                    break
                hits += 1
            return hits

    def lock_present(self, keys: Sequence[ObjectKey], count: int) -> dict[ObjectKey, L1Object]:
        """``L1Manager.reserve_read``: every READY key present, each locked once."""
        check_lock_count(count)
        with self._lock:
            hits = self._lock_present(keys, count)
            self._table.listeners.notify("read", list(hits))
            return hits

    def _lock_present(self, keys: Sequence[ObjectKey], count: int) -> dict[ObjectKey, L1Object]:
        """``lock_present`` without telling the listeners; the caller holds the lock."""
        table = self._table
        table.check_open()
        objects, locked = table.objects, table.locked
        hits: dict[ObjectKey, L1Object] = {}
        deadline = read_lock_deadline(time.monotonic(), self.lock_ttl_s)
        locked_bytes = 0
        for key in keys:
            obj = objects.get(key)
            if obj is None or obj.state is not _READY or key in hits:
                continue
            if not obj.read_locks:
                locked[key] = obj
                locked_bytes += obj.extent_bytes
                obj.read_locks = count
                obj.lock_deadline = deadline
            elif obj.lock_deadline == deadline:
                # Its latest deadline is this grid step's: the locks join its last group.
                obj.read_locks += count
                if obj.lock_groups is not None:
                    obj.lock_groups[-1] += count
            else:
                add_read_locks(obj, count, deadline)
            hits[key] = obj
        table.locked_extent_bytes += locked_bytes
        if hits:
            table.deadlines.reading(deadline).update(hits.values())
        return hits

    def lock_prefix(
        self,
        keys: Sequence[ObjectKey],
        count: int,
        *,
        until_repeat: bool = False,
        generations: list[int] | None = None,
    ) -> list[L1Object]:
        """``L1Manager.reserve_read_prefix``: the leading READY keys, in one pass."""
        if count < 1:
            check_lock_count(count)  # raises
        with self._lock:
            # No open check: a closed manager holds no objects, so nothing is locked.
            table = self._table
            last = self._last_hit
            if last is not None and last[0] == table.ready_version and last[1] == keys:
                # The very keys of the last call that found all of them, distinct, and no
                # READY object came or went since: the same objects, still distinct (a
                # list comparison, by identity first, instead of a probe per key).
                unique = prefix = list(last[2])
                # A copy: a listener (an eviction policy plugin) that reorders the list it
                # is told would otherwise reorder the remembered keys, and the next call
                # with those keys would get their objects at the wrong positions.
                read = list(last[1])
            else:
                prefix, unique, read = self._find_prefix(keys, until_repeat)
                if not prefix:
                    return prefix
            locked = table.locked
            deadline = self.lock_deadline(time.monotonic())
            locked_bytes = 0
            # An object whose latest deadline is ``deadline`` was filed under it when it
            # took those locks, and stays filed until the cell ends (after ``deadline``,
            # later than now), released since or not (a release takes nothing out, and
            # leaves the deadline): only one taking its first lock of this cell must be
            # filed.  (A committed object keeps no write deadline there: ``make_ready``.)
            # Unless a reap was given a time past the clock's (``expire_locks(inf)``) and
            # emptied the cell before it ended: then every object is filed again (NaN
            # equals no deadline).
            filed_at = deadline if deadline > table.deadlines.reaped_through else math.nan
            filed = True
            for obj in unique:
                # A READY object is in ``locked`` exactly when it has read locks.
                if not obj.read_locks:
                    locked[obj.key] = obj
                    locked_bytes += obj.extent_bytes
                    obj.read_locks = count
                    if obj.lock_deadline != filed_at:
                        # (Equal: locked and released within this cell, an engine's
                        # lookup after its release of the same prompt, filed already.)
                        obj.lock_deadline = deadline
                        filed = False
                elif obj.lock_deadline == filed_at:
                    # Its latest deadline is this grid step's (a hot prefix locked by
                    # several readers within a step, maybe also holding locks of earlier
                    # steps): the locks join its last group, without a call per object.
                    obj.read_locks += count
                    groups = obj.lock_groups
                    if groups is not None:
                        groups[-1] += count
                else:
                    add_read_locks(obj, count, deadline)
                    filed = False
            table.locked_extent_bytes += locked_bytes
            if not filed:
                # Each took locks expiring at ``deadline``: one C-level pass files them there.
                table.deadlines.reading(deadline).update(unique)
            if generations is not None:
                # Under the hold that took the locks: once it is let go, a forced delete
                # and a release of the key (credited to the quarantined extent) can give
                # an extent back, moving its generation, before the caller reads it.
                generations += self._leases.generations(prefix)
            table.listeners.notify("read", read)
            return prefix

    def _find_prefix(
        self, keys: Sequence[ObjectKey], until_repeat: bool
    ) -> tuple[list[L1Object], list[L1Object], list[ObjectKey]]:
        """(prefix objects, the distinct ones among them, their keys) of ``lock_prefix``;
        a prefix that is every key, each once, is remembered for the next call."""
        table = self._table
        ready = table.ready
        if not keys or keys[0] not in ready:
            # A new prompt: nothing to lock, and no key past the first is probed (hashing a
            # key just decoded costs more than finding it).
            return [], [], []
        # The prefix is found with C-level passes (one probe of the READY objects per key,
        # then the first miss), which is most of the cost of a lookup.
        found: list[L1Object | None] = list(map(ready.get, keys))
        if not all(found):  # objects are never false, None is
            del found[found.index(None) :]
        prefix = cast("list[L1Object]", found)
        if not prefix:
            return prefix, prefix, []
        # Deduplicated by object identity (a cheap hash, in C) rather than by key: one
        # READY object per key, so equal objects are exactly equal keys.
        if len(set(prefix)) == len(prefix):
            # The caller's keys equal the objects' own: no pass to fetch those.  (With the
            # objects' own the eviction policy finds each by identity, fewer instructions,
            # yet a served 512-key lookup took ~15% longer: the caller's keys were just
            # decoded and are in the cache, the objects' own are not.)
            read = keys[: len(prefix)] if type(keys) is list else list(keys[: len(prefix)])
            if len(prefix) == len(keys):
                # Copies of their own: the caller may change its list, the listeners the
                # ``read`` they are told, and the caller keeps ``prefix``.
                self._last_hit = (table.ready_version, list(read), list(prefix))
            return prefix, prefix, read
        if until_repeat:
            del prefix[_first_repeat(prefix) :]
            unique = prefix
        else:
            unique = list(dict.fromkeys(prefix))
        return prefix, unique, list(map(_KEY_OF, unique))

    def release(self, keys: Sequence[ObjectKey], count: int, not_before: float | None = None) -> None:
        """``L1Manager.finish_read``: drop ``count`` locks per key, quarantined extents first."""
        if count < 1:
            check_lock_count(count)  # raises
        with self._lock:
            table = self._table
            objects, locked = table.objects, table.locked
            freed: list[L1Object] = []
            unlocked_bytes = 0
            set_aside = table.set_aside
            leases = self._leases
            last = self._last_hit
            if last is not None and last[0] == table.ready_version and last[1] == keys:
                # The keys of the last lookup that found them all, each once, and no READY
                # object came or went since (an engine releasing the prompt it just looked
                # up): its objects are theirs, with no probe per key.
                distinct: Sequence[ObjectKey] = keys
                found: Iterable[L1Object | None] = last[2]
            else:
                # Each key once (a set only checks: cheaper than building the deduplicated
                # list when, as nearly always, there is nothing to remove).
                distinct = keys if len(set(keys)) == len(keys) else list(dict.fromkeys(keys))
                found = map(objects.get, distinct)
            now = 0.0  # read once, only if an object's locks have several deadlines
            batches: Iterable[tuple[int, Iterable[L1Object | None]]]
            if leases.any_holders:
                # Locks on quarantined extents are credited first: per key, what is left
                # over goes to the live object.  The objects are grouped by what is left
                # for them, so that the loop below takes one amount per group.
                now = time.monotonic()
                by_left: dict[int, list[L1Object | None]] = {}
                for obj, key in zip(found, distinct, strict=True):
                    left = leases.credit(key, count, now) if leases.has_holders(key) else count
                    by_left.setdefault(left, []).append(obj)
                batches = by_left.items()
            else:  # the usual case: every lock released is the live object's
                batches = ((count, found),)
            # The objects are found in one C-level pass; what is left per object is plain
            # arithmetic (this runs for every key of every RELEASE): a plain loop over
            # them, no pairing of each with its amount (a zip took a sixth of a release).
            for left, group in batches:
                if not left:
                    continue
                for obj in group:
                    if obj is None:
                        continue
                    # A reader's release never takes an L2 store's lock (``release_store``).
                    held = obj.read_locks
                    storing = obj.storing  # read once: each attribute read is paid per key
                    remaining = held - left
                    if remaining > storing:
                        obj.read_locks = remaining
                        if obj.lock_groups is not None:
                            if not now:
                                now = time.monotonic()
                            _drop_read_locks(obj, left, now, not_before)
                    elif held > storing:  # its readers' last locks
                        obj.lock_groups = None
                        obj.read_locks = storing
                        if not storing:  # unlocked now
                            del locked[obj.key]
                            unlocked_bytes += obj.extent_bytes
                            if obj in set_aside:  # its key is due back in eviction walks
                                table.end_set_aside(obj)
                            if obj.temporary:
                                freed.append(obj)
            table.locked_extent_bytes -= unlocked_bytes
            if freed:  # rarely: a call with none still built the listeners' empty key list
                table.free(freed)

    def lock_for_store(self, keys: Sequence[ObjectKey]) -> dict[ObjectKey, L1Object]:
        """``L1Manager.reserve_store``: ``lock_present`` once, each object pinned for a store."""
        with self._lock:
            table = self._table
            table.check_open()
            objects, locked = table.objects, table.locked
            hits: dict[ObjectKey, L1Object] = {}
            for key in keys:
                obj = objects.get(key)
                if obj is None or obj.state is not _READY or key in hits:
                    continue
                # No deadline: a store's lock is not reaped, and its report drops exactly
                # it (readers' locks are ``read_locks - storing``).
                if not obj.read_locks:
                    locked[key] = obj
                    table.locked_extent_bytes += obj.extent_bytes
                obj.read_locks += 1
                obj.storing += 1
                hits[key] = obj
            # Only now: a listener that deletes them by force must find the store's locks
            # marked as such, or their extents would be held as if a reader had them.
            self._table.listeners.notify("read", list(hits))
            return hits

    def release_store(self, objs: Iterable[L1Object]) -> None:
        """``L1Manager.finish_store``: drop the store's lock and pin on each object -- the
        object itself, never a later one of its key."""
        with self._lock:
            table = self._table
            objects, locked = table.objects, table.locked
            freed: list[L1Object] = []
            for obj in objs:
                obj.storing -= 1
                if objects.get(obj.key) is obj:
                    if obj.read_locks > 1:
                        obj.read_locks -= 1
                    elif obj.read_locks:
                        obj.read_locks = 0
                        del locked[obj.key]
                        table.locked_extent_bytes -= obj.extent_bytes
                        if obj in table.set_aside:  # its key is due back in eviction walks
                            table.end_set_aside(obj)
                        if obj.temporary:
                            freed.append(obj)
                    continue
                # Deleted by force while stored: the leases pinned its extent for the store.
                # Readers that were still holding it keep it quarantined for their lease.
                obj.read_locks = max(0, obj.read_locks - 1)
                if not obj.storing:
                    self._leases.store_done(obj, time.monotonic())
            table.free(freed)

    def set_temporary(self, keys: Sequence[ObjectKey], temporary: bool) -> None:
        with self._lock:
            table = self._table
            for key in keys:
                obj = table.objects.get(key)
                if obj is None:
                    continue
                obj.temporary = temporary
                if temporary:
                    table.temporary.add(key)
                else:
                    table.temporary.discard(key)


def add_read_locks(obj: L1Object, count: int, deadline: float) -> None:
    """``count`` more read locks on the read-locked ``obj``, expiring at ``deadline``.

    Every read-lock deadline is ``read_lock_deadline`` of the monotonic clock, read under
    the L1 lock, so ``deadline`` is never earlier than the object's others: it joins the
    last group (equal deadlines are one group: the grid keeps them few) or starts a new one
    at the end (an earlier one is still put in its place).  ``lock_deadline`` is always the
    last group's deadline, so the lock paths join that group inline when ``deadline`` is
    it, and call this only for another one.
    """
    readers = obj.read_locks - obj.storing
    obj.read_locks += count
    groups = obj.lock_groups
    if groups is None:
        latest = obj.lock_deadline
        if not readers or latest == deadline:
            obj.lock_deadline = deadline
        elif latest < deadline:
            obj.lock_groups = [latest, readers, deadline, count]
            obj.lock_deadline = deadline
        else:
            obj.lock_groups = [deadline, count, latest, readers]
    elif groups[-2] == deadline:
        groups[-1] += count
    elif groups[-2] < deadline:
        groups += (deadline, count)
        obj.lock_deadline = deadline
    else:
        position = 0
        while groups[position] < deadline:
            position += 2
        if groups[position] == deadline:
            groups[position + 1] += count
        else:
            groups[position:position] = (deadline, count)


def _drop_read_locks(obj: L1Object, count: int, now: float, not_before: float | None) -> None:
    """Take ``count`` of ``obj``'s readers' locks (fewer than it holds, already taken off
    ``read_locks``) out of its deadline groups: those with the earliest deadline from
    ``not_before`` on (without it: after ``now``) first; then (a holder released a lock it
    no longer held) the earliest of the others, expired ones before any still live."""
    groups = obj.lock_groups
    assert groups is not None
    # Locks expiring before ``not_before`` are not the caller's: maybe forgotten by theirs.
    # Given ``not_before``, ``now`` skips nothing: the caller saw its locks live at a time
    # read before this one, so one of them may have expired since (unreaped) -- skipping
    # it would drop another holder's live lock in its place.
    first = 0
    floor = now if not_before is None else -math.inf
    while first < len(groups) and (
        groups[first] <= floor or (not_before is not None and groups[first] < not_before)
    ):
        first += 2
    for position in [*range(first, len(groups), 2), *range(0, first, 2)]:
        held = int(groups[position + 1])
        taken = min(held, count)
        groups[position + 1] = held - taken
        count -= taken
        if not count:
            break
    kept: list[float] = []
    for position in range(0, len(groups), 2):
        if groups[position + 1]:
            kept += groups[position : position + 2]
    _set_groups(obj, kept)


def reap_read_locks(obj: L1Object, now: float) -> int:
    """Drop the readers' locks on ``obj`` whose deadline is ``now`` or earlier (taken off
    ``read_locks``); returns how many."""
    groups = obj.lock_groups
    if groups is None:
        if obj.lock_deadline > now:
            return 0
        reaped = obj.read_locks - obj.storing
        obj.read_locks = obj.storing
        return reaped
    if groups[0] > now:
        return 0
    first = 0
    while first < len(groups) and groups[first] <= now:
        first += 2
    reaped = int(sum(groups[1:first:2]))
    obj.read_locks -= reaped
    _set_groups(obj, groups[first:])
    return reaped


def _set_groups(obj: L1Object, groups: list[float]) -> None:
    """``obj``'s readers' locks per deadline are now ``groups`` (earliest first)."""
    if len(groups) > 2:
        obj.lock_groups = groups
        obj.lock_deadline = groups[-2]
    else:
        obj.lock_groups = None
        if groups:
            obj.lock_deadline = groups[0]


def _first_repeat(objects: list[L1Object]) -> int:
    """Position of the first object that already came before (the list holds a repeat)."""
    seen: set[L1Object] = set()
    for position, obj in enumerate(objects):
        if obj in seen:
            return position
        seen.add(obj)
    return len(objects)
