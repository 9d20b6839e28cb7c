"""The object table of one L1: every object by key, the indexes kept beside it, and the
one way objects leave.

``objects`` holds every object in any state.  ``ready`` holds the READY ones (a lookup
finds its prefix with one probe per key and no state test), ``locked`` the ones under a
write lock or read locks, and ``temporary`` the keys freed after their last read, so stats
cost O(locked) rather than O(objects); ``deadlines`` files the locked objects by when their
locks expire, so TTL reaping costs what expired (``l1/deadlines.py``).

``locked_extent_bytes`` is the running total of the extents of ``locked``'s objects: whoever
adds an object to ``locked`` or takes one out adds or subtracts its ``extent_bytes``
(reads.py and writes.py inline, in their loops; the rest here).  With the extents held for
loads (``_held``, kept here too) it is what no eviction frees, asked by every write that
finds L1 full: a walk of the locked objects under the L1 lock cost O(locked) per such write
(~5 ms of CPU with 10k read locks, ~30 with 100k), the total costs an add per lock change.

An object leaves by being detached from the table and having its extent released: back
to the allocator through the leases (which may quarantine it, or pin it for an L2 store
still reading it, see ``l1/leases.py``), or held while a prefetch's load may still be
writing into it.  Listeners hear about it once, after the call's state change is complete
(see ``l1/manager.py``).

Not thread-safe: every caller holds the L1 manager's lock.
"""

from __future__ import annotations

import logging
import time
from typing import Literal

from lmcache_tiers.burst import PolicyFailureLog
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1.deadlines import LockDeadlines
from lmcache_tiers.l1.leases import ExtentLeases, TakenBy
from lmcache_tiers.l1.objects import L1Listener, L1Object, L1Stats, ObjectState

logger = logging.getLogger(__name__)

L1Event = Literal["written", "read", "deleted"]


def check_lock_count(count: int) -> None:
    if count < 1:
        raise ValueError(f"lock count must be at least 1, got {count}")


class L1Listeners:
    """The registered listeners, told about each call's changes in registration order."""

    def __init__(self) -> None:
        # A tuple, replaced on each change: a notification (one per lookup) walks the
        # listeners of its start without copying them.
        self._listeners: tuple[L1Listener, ...] = ()
        #: notifications a listener raised on: changes it may not have seen
        self.errors = 0
        # A listener with a bug fails on every notification: one traceback, then a line a burst.
        self._failures_log = PolicyFailureLog(logger, "l1_listener_error")

    def add(self, listener: L1Listener) -> None:
        self._listeners = (*self._listeners, listener)

    def remove(self, listener: L1Listener) -> None:
        listeners = list(self._listeners)
        listeners.remove(listener)
        self._listeners = tuple(listeners)

    def clear(self) -> None:
        self._listeners = ()

    def notify(self, event: L1Event, keys: list[ObjectKey]) -> None:
        if not keys:
            return
        for listener in self._listeners:
            try:
                if event == "written":
                    listener.on_l1_keys_written(keys)
                elif event == "read":
                    listener.on_l1_keys_read(keys)
                else:
                    listener.on_l1_keys_deleted(keys)
            except Exception:
                # L1 state is already consistent; one faulty listener must not fail the
                # caller's request or starve the listeners after it.
                self.errors += 1
                self._failures_log.failed(
                    "L1 listener %r failed on %s of %d keys", listener, event, len(keys)
                )


class ObjectTable:
    """Objects by key, with the locked and temporary indexes and the held load extents."""

    def __init__(self, leases: ExtentLeases, listeners: L1Listeners) -> None:
        self.objects: dict[ObjectKey, L1Object] = {}
        self.ready: dict[ObjectKey, L1Object] = {}  # READY objects of ``objects``
        self.locked: dict[ObjectKey, L1Object] = {}
        #: the sum of ``extent_bytes`` over ``locked`` (see the module docstring)
        self.locked_extent_bytes = 0
        #: read-locked objects whose keys eviction set aside (``make_room``'s
        #: ``passed_locked``): whoever takes one out of ``locked`` -- its last lock released
        #: (reads.py) or reaped (removal.py), or the object detached with its locks (a
        #: forced delete, a disk error) -- moves it to ``set_aside_ended`` (``end_set_aside``),
        #: a set probe per unlock, so the look before each eviction walk costs the keys
        #: whose locks ended, not every key set aside.  Identity-hashed: a later object of
        #: the same key is not in it.
        self.set_aside: set[L1Object] = set()
        #: objects of ``set_aside`` whose locks ended since the last eviction walk, or that
        #: left L1, in that order: their keys are to go back into the policy's walks
        self.set_aside_ended: list[L1Object] = []
        self.temporary: set[ObjectKey] = set()
        #: locked objects by when their locks expire: whoever gives an object a read-lock
        #: deadline files it under it (reads.py, writes.py); reservations come and go here
        self.deadlines = LockDeadlines()
        #: bumped whenever ``ready`` changes, so a caller can tell that a probe it made
        #: of READY objects would find the same objects again
        self.ready_version = 0
        self.listeners = listeners
        self.closed = False
        self._leases = leases
        # Load reservations that left L1 (write TTL) while their load may still be writing
        # into them: their extents stay allocated until the prefetch lets go (abort_load).
        # Extents an L2 store still reads are pinned by the leases instead, which also
        # credit the releases of the object's readers to them.
        self._held: set[L1Object] = set()
        self._held_extent_bytes = 0
        #: bytes of the objects in the table flagged unstored (``l1/handoffs.py``): acknowledged
        #: writes stored in no L2 yet, which write-back pacing weighs against L1's capacity
        self.unstored_bytes = 0

    def writes_ended(self, unlocked_bytes: int) -> None:
        """Write reservations made READY without read locks left ``locked``: none of them
        was set aside (only READY objects are), so only the total moves."""
        self.locked_extent_bytes -= unlocked_bytes

    def end_set_aside(self, obj: L1Object) -> None:
        """``obj``, one of ``set_aside``, is unlocked or left L1: its key is due back in the
        eviction policy's walks (``Removal.take_unlocked_set_aside``).  Callers test
        membership first, inline, as they do on every unlock."""
        self.set_aside.discard(obj)
        self.set_aside_ended.append(obj)

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the L1 manager is closed")

    def check_present(self, obj: L1Object) -> None:
        """Raise KeyError unless ``obj`` itself (not a later object of its key) is in L1."""
        self.check_open()
        if self.objects.get(obj.key) is not obj:
            raise KeyError(f"{obj.key} is no longer in L1")

    def insert_many(self, objs: dict[ObjectKey, L1Object], temporary: bool) -> None:
        """Add new, write-locked objects (by key), all ``temporary`` or none."""
        self.objects.update(objs)
        self.locked.update(objs)
        self.deadlines.writing.update(dict.fromkeys(objs.values()))
        self.locked_extent_bytes += sum(obj.extent_bytes for obj in objs.values())
        if temporary:
            self.temporary.update(objs)

    def index_ready(self, objs: list[L1Object]) -> None:
        """Objects of the table just made READY (readable) join the ready index."""
        if not objs:
            return
        ready = self.ready
        for obj in objs:
            ready[obj.key] = obj
        self.ready_version += 1

    def detach(self, obj: L1Object) -> None:
        """Take ``obj`` out of the table; its extent is still to be released."""
        del self.objects[obj.key]
        if obj.unstored:  # the flag stays (its store may still count it): the bytes leave L1
            self.unstored_bytes -= obj.size
        if self.ready.pop(obj.key, None) is not None:
            self.ready_version += 1
        elif obj.state is ObjectState.WRITING:
            del self.deadlines.writing[obj]
        unlocked = self.locked.pop(obj.key, None)
        if unlocked is not None:
            self.locked_extent_bytes -= unlocked.extent_bytes
            # Leaving with its locks (forced delete, disk error): its readers' releases go
            # to its quarantined extent, so no unlock of it would ever end its set-aside.
            if unlocked in self.set_aside:
                self.end_set_aside(unlocked)
        self.temporary.discard(obj.key)

    def release_extents(self, objs: list[L1Object], taken_by: TakenBy = "forced") -> None:
        """Give back the extents of detached objects, except those a load is still filling
        (the leases keep those an L2 store still reads, and those of read-locked objects,
        which ``taken_by`` took away)."""
        if not objs:
            return
        # Handing such an extent to another object would let the load overwrite that
        # object's bytes.  abort_load frees it.
        free = [obj for obj in objs if not obj.loading]
        if len(free) < len(objs):
            for obj in objs:
                if obj.loading and obj not in self._held:
                    self._held.add(obj)
                    self._held_extent_bytes += obj.extent_bytes
        if free:
            self._leases.release_extents(free, time.monotonic(), taken_by)

    def release_held(self, obj: L1Object) -> bool:
        """True if ``obj`` left L1 while a load filled it and its extent was held for
        that: the caller (the load's end) then releases the extent."""
        if obj not in self._held:
            return False
        self._held.discard(obj)
        self._held_extent_bytes -= obj.extent_bytes
        return True

    def free(self, objs: list[L1Object], taken_by: TakenBy = "forced") -> None:
        """Detach objects, release their extents and tell the listeners they are gone."""
        for obj in objs:
            self.detach(obj)
        self.release_extents(objs, taken_by)
        self.listeners.notify("deleted", [obj.key for obj in objs])

    @property
    def unevictable_bytes(self) -> int:
        """Bytes that no eviction can free: extents of locked objects, and those held for
        loads whose reservation left L1 (allocated, but in no object to evict).  O(1)."""
        return self.locked_extent_bytes + self._held_extent_bytes

    def unevictable(self) -> list[L1Object]:
        """The objects whose extents no eviction frees: locked ones, and those held for
        loads whose reservation left L1 (``unevictable_bytes`` is their size)."""
        return [*self.locked.values(), *self._held]

    def unevictable_count(self) -> int:
        """How many objects :meth:`unevictable` lists, without listing them."""
        return len(self.locked) + len(self._held)

    def stats(self, used_bytes: int) -> L1Stats:
        write_locked = sum(1 for obj in self.locked.values() if obj.state is ObjectState.WRITING)
        read_locks = sum(obj.read_locks for obj in self.locked.values())
        return L1Stats(
            objects=len(self.objects),
            used_bytes=used_bytes,
            write_locked=write_locked,
            read_locks=read_locks,
            temporary=len(self.temporary),
        )

    def close(self) -> None:
        """Forget every object, without notifying listeners (and forget the listeners)."""
        self.closed = True
        self.objects.clear()
        self.ready.clear()
        self.ready_version += 1
        self.locked.clear()
        self.locked_extent_bytes = 0
        self.unstored_bytes = 0
        self.set_aside.clear()
        self.set_aside_ended.clear()
        self.temporary.clear()
        self.deadlines.clear()
        self.listeners.clear()
