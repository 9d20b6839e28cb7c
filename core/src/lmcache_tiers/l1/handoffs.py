"""Hand-offs between L1 and L2: committed objects waiting for their L2 store, and
reservations that a prefetch fills from L2.

An *unstored* object (``mark_unstored`` .. ``settle_unstored``) holds the only copy of an
acknowledged write, so eviction takes it last (``l1/removal.py``).

A *load* reservation (``reserve_load``) is finished (``finish_load``) or freed
(``abort_load``) only by the prefetch that made it, by object identity: a writer's commit
or abort of the same key never publishes or frees it, so bytes whose load failed can never
become readable or be queued for L2 as if freshly written.  A load reservation that leaves
L1 while its load runs (its write TTL passed; deletes and clears skip it) keeps its extent
until ``abort_load`` (``l1/table.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1.objects import L1Object, ObjectState
from lmcache_tiers.l1.table import ObjectTable, check_lock_count
from lmcache_tiers.l1.writes import WriteReservations

_READY = ObjectState.READY
_WRITING = ObjectState.WRITING


class L2Handoffs:
    """Unstored flags and load reservations; every method takes the L1 lock."""

    def __init__(self, lock: threading.RLock, table: ObjectTable, writes: WriteReservations) -> None:
        self._lock = lock
        self._table = table
        self._writes = writes

    def mark_unstored(self, keys: Sequence[ObjectKey]) -> list[L1Object]:
        with self._lock:
            objects = self._table.objects
            marked: list[L1Object] = []
            for key in keys:
                obj = objects.get(key)
                if obj is not None and obj.state is _READY:
                    if not obj.unstored:
                        obj.unstored = True
                        self._table.unstored_bytes += obj.size
                    marked.append(obj)
            return marked

    def settle_unstored(self, objs: Iterable[L1Object]) -> None:
        with self._lock:
            objects = self._table.objects
            for obj in objs:
                # One that left L1 took its bytes out of the total as it went (``detach``).
                if obj.unstored and objects.get(obj.key) is obj:
                    self._table.unstored_bytes -= obj.size
                obj.unstored = False

    def reserve_load(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], *, temporary: bool
    ) -> dict[ObjectKey, L1Object]:
        with self._lock:
            reserved = self._writes.reserve(keys, sizes, temporary=temporary, layouts=None, load=True)
            for obj in reserved.values():
                obj.loading = True
            return reserved

    def finish_load(self, objs: Sequence[L1Object], count: int, layouts: Sequence[str] | None) -> list[bool]:
        check_lock_count(count)
        with self._lock:
            table = self._table
            table.check_open()
            objects = table.objects
            current = [obj if objects.get(obj.key) is obj else None for obj in objs]
            if layouts is not None:
                for obj, layout in zip(current, layouts, strict=True):
                    if obj is not None and layout:
                        obj.layout = layout
            return self._writes.make_ready(current, count, loads=True)

    def abort_load(self, objs: Iterable[L1Object]) -> None:
        with self._lock:
            table = self._table
            objects = table.objects
            present: list[L1Object] = []
            held: list[L1Object] = []
            for obj in dict.fromkeys(objs):
                if table.release_held(obj):
                    held.append(obj)
                elif objects.get(obj.key) is obj and obj.state is _WRITING and obj.loading:
                    present.append(obj)
                else:
                    continue
                obj.loading = False
            table.release_extents(held)  # detached, and reported deleted, already
            table.free(present)
