"""Write reservations: reserve (WRITING, write-locked) -> filled by the writer -> finished
(READY) or aborted (freed).

A prefetch that fills objects from L2 reserves them the same way, flagged ``loading``; only
that prefetch finishes or frees them (``l1/handoffs.py``), so a writer's commit or abort of
the same key never touches them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1.allocator import ExtentAllocator
from lmcache_tiers.l1.leases import ExtentLeases
from lmcache_tiers.l1.objects import L1Object, ObjectState
from lmcache_tiers.l1.reads import read_lock_deadline
from lmcache_tiers.l1.table import ObjectTable

_WRITING = ObjectState.WRITING


class WriteReservations:
    """Reserving, finishing and aborting writes; every method takes the L1 lock."""

    def __init__(
        self,
        lock: threading.RLock,
        table: ObjectTable,
        allocator: ExtentAllocator,
        leases: ExtentLeases,
        *,
        lock_ttl_s: float,
        write_ttl_s: float,
    ) -> None:
        self._lock = lock
        self._table = table
        self._allocator = allocator
        self._leases = leases
        self.lock_ttl_s = lock_ttl_s
        self.write_ttl_s = write_ttl_s

    def reserve(
        self,
        keys: Sequence[ObjectKey],
        sizes: Sequence[int],
        *,
        temporary: bool,
        layouts: Sequence[str] | None,
    ) -> dict[ObjectKey, L1Object]:
        """``L1Manager.reserve_write``: the new keys, all or nothing."""
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        if layouts is not None and len(layouts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(layouts)} layouts")
        with self._lock:
            table = self._table
            table.check_open()
            objects = table.objects
            wanted: dict[ObjectKey, int] = {}
            wanted_layouts: dict[ObjectKey, str] = {}
            for position, (key, size) in enumerate(zip(keys, sizes, strict=True)):
                if key not in objects and key not in wanted:
                    wanted[key] = size
                    if layouts is not None and layouts[position]:
                        wanted_layouts[key] = layouts[position]
            if not wanted:
                return {}
            allocator = self._allocator
            offsets = allocator.allocate_many(list(wanted.values()))
            if offsets is None and self._leases.reclaim(time.monotonic()):
                offsets = allocator.allocate_many(list(wanted.values()))
            if offsets is None:
                need = sum(allocator.extent_size(size) for size in wanted.values())
                raise L1OutOfMemoryError(
                    f"L1 cannot hold {len(wanted)} new objects ({need} bytes): {allocator.free_bytes} of "
                    f"{allocator.capacity} bytes free, largest free extent {allocator.largest_free_extent()}"
                )
            deadline = time.monotonic() + self.write_ttl_s
            reserved: dict[ObjectKey, L1Object] = {}
            for (key, size), offset in zip(wanted.items(), offsets, strict=True):
                obj = L1Object(
                    key, offset, size, temporary, _WRITING, 0, deadline, wanted_layouts.get(key, "")
                )
                table.insert(obj)
                reserved[key] = obj
            return reserved

    def finish(self, keys: Sequence[ObjectKey], read_count: int) -> list[bool]:
        """A writer's reservations of ``keys``: READY, read-locked ``read_count`` times."""
        with self._lock:
            self._table.check_open()
            objects = self._table.objects
            # A reservation made by a prefetch is finished by that prefetch only (finish_load).
            return self.make_ready([objects.get(key) for key in keys], read_count, loads=False)

    def make_ready(self, objs: Sequence[L1Object | None], read_count: int, *, loads: bool) -> list[bool]:
        """WRITING -> READY, read-locked ``read_count`` times; None and reservations of the
        other kind (a prefetch's when not ``loads``, a writer's when ``loads``) are refused.
        The caller holds the lock."""
        done: list[bool] = []
        written: list[ObjectKey] = []
        locked = self._table.locked
        deadline = read_lock_deadline(time.monotonic(), self.lock_ttl_s)  # on the grid, as every read lock's
        for obj in objs:
            if obj is None or obj.state is not _WRITING or obj.loading is not loads:
                done.append(False)
                continue
            obj.loading = False
            self._table.mark_ready(obj)
            obj.read_locks = read_count
            if read_count:
                obj.lock_deadline = deadline
            else:
                del locked[obj.key]
            written.append(obj.key)
            done.append(True)
        self._table.listeners.notify("written", written)
        return done

    def abort(self, keys: Sequence[ObjectKey]) -> None:
        """Free a writer's reservations of ``keys``; other keys are left alone."""
        with self._lock:
            objects = self._table.objects
            aborted: list[L1Object] = []
            for key in dict.fromkeys(keys):
                obj = objects.get(key)
                if obj is not None and obj.state is _WRITING and not obj.loading:
                    aborted.append(obj)
            self._table.free(aborted)
