"""Read locks: counted, with one deadline per object, taken on READY objects and dropped
by their readers (or reaped at their TTL, ``l1/removal.py``).

A temporary object is freed when its last read lock is dropped.  Locks on an extent that
a forced delete quarantined are credited to it before the key's live object
(``l1/leases.py``).  ``lock_prefix`` and ``release`` run on every lookup and retrieve: they
make one pass over the keys, with the table's dicts in locals.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import attrgetter
from typing import cast

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1.leases import ExtentLeases
from lmcache_tiers.l1.objects import L1Object, ObjectState
from lmcache_tiers.l1.table import ObjectTable, check_lock_count

_READY = ObjectState.READY
_KEY_OF = attrgetter("key")


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
        deadline = time.monotonic() + self.lock_ttl_s
        for key in keys:
            obj = objects.get(key)
            if obj is None or obj.state is not _READY or key in hits:
                continue
            obj.read_locks += count
            # One deadline per object: a new reader extends it, and reaping drops all
            # of the object's read locks at once.
            obj.lock_deadline = max(obj.lock_deadline, deadline) if key in locked else deadline
            locked[key] = obj
            hits[key] = obj
        return hits

    def lock_prefix(
        self, keys: Sequence[ObjectKey], count: int, *, until_repeat: bool = False
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
            deadline = time.monotonic() + self.lock_ttl_s
            for obj in unique:
                # A READY object is in ``locked`` exactly when it has read locks.  Every
                # read-lock deadline is the monotonic clock plus the lock TTL, read under
                # this lock, so this one is never earlier than the object's current one.
                if not obj.read_locks:
                    locked[obj.key] = obj
                obj.read_locks += count
                obj.lock_deadline = deadline
            table.listeners.notify("read", read)
            return prefix

    def _find_prefix(
        self, keys: Sequence[ObjectKey], until_repeat: bool
    ) -> tuple[list[L1Object], list[L1Object], list[ObjectKey]]:
        """(prefix objects, the distinct ones among them, their keys) of ``lock_prefix``;
        a prefix that is every key, each once, is remembered for the next call."""
        table = self._table
        # The prefix is found with C-level passes (one probe of the READY objects per key,
        # then the first miss), which is most of the cost of a lookup.
        found: list[L1Object | None] = list(map(table.ready.get, keys))
        if not all(found):  # objects are never false, None is
            del found[found.index(None) :]
        prefix = cast("list[L1Object]", found)
        if not prefix:
            return prefix, prefix, []
        # Deduplicated by object identity (a cheap hash, in C) rather than by key: one
        # READY object per key, so equal objects are exactly equal keys.
        if len(set(prefix)) == len(prefix):
            # The caller's keys equal the objects' own: no pass to fetch those.
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

    def release(self, keys: Sequence[ObjectKey], count: int) -> None:
        """``L1Manager.finish_read``: drop ``count`` locks per key, quarantined extents first."""
        check_lock_count(count)
        with self._lock:
            table = self._table
            objects, locked = table.objects, table.locked
            freed: list[L1Object] = []
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
            if leases.any_holders:
                # Locks on quarantined extents are credited first: per key, what is left
                # over goes to the live object.
                now = time.monotonic()
                lefts: Iterable[int] = [
                    leases.credit(key, count, now) if leases.has_holders(key) else count for key in distinct
                ]
            else:  # the usual case: every lock released is the live object's
                lefts = repeat(count)
            # The objects are found in one C-level pass; what is left per object is plain
            # arithmetic (this runs for every key of every RELEASE).
            for obj, left in zip(found, lefts, strict=False):  # lefts may repeat
                if obj is None or not left:
                    continue
                remaining = obj.read_locks - left
                if remaining > 0:
                    obj.read_locks = remaining
                elif obj.read_locks:  # its last locks: unlocked now
                    obj.read_locks = 0
                    del locked[obj.key]
                    if obj.temporary:
                        freed.append(obj)
            table.free(freed)

    def lock_for_store(self, keys: Sequence[ObjectKey]) -> dict[ObjectKey, L1Object]:
        """``L1Manager.reserve_store``: ``lock_present`` once, each object pinned for a store."""
        with self._lock:
            hits = self._lock_present(keys, 1)
            for obj in hits.values():
                obj.storing += 1
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


def _first_repeat(objects: list[L1Object]) -> int:
    """Position of the first object that already came before (the list holds a repeat)."""
    seen: set[L1Object] = set()
    for position, obj in enumerate(objects):
        if obj in seen:
            return position
        seen.add(obj)
    return len(objects)
