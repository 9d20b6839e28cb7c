"""Write reservations: reserve (WRITING, write-locked) -> filled by the writer -> finished
(READY) or aborted (freed).

A prefetch that fills objects from L2 reserves them the same way, flagged ``loading``; only
that prefetch finishes or frees them (``l1/handoffs.py``), so a writer's commit or abort of
the same key never touches them.

A writer is never skipped behind a load: the load may fail (L2's copy damaged) after the
writer was told the key is there, leaving its acknowledged write in no tier.  The load's
reservation gives way instead -- it leaves L1, its extent held until the prefetch lets go
(``abort_load``), and its ``finish_load`` is refused: a miss for that reader, counted
(``l1_load_taken_over_by_write``).  A writer skipped behind another writer's reservation
cannot be helped so (that client may be copying into it; the bytes are the same, since
keys name contents): if that reservation then ends uncommitted -- aborted by a client that
crashed mid-copy, or reaped at the write TTL -- the skipped writes are acknowledged writes
no tier holds, counted (``l1_skipped_writes_lost``) and logged.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1.allocator import ExtentAllocator
from lmcache_tiers.l1.leases import ExtentLeases
from lmcache_tiers.l1.objects import L1Object, ObjectState
from lmcache_tiers.l1.reads import read_lock_deadline
from lmcache_tiers.l1.table import ObjectTable

logger = logging.getLogger(__name__)

_WRITING = ObjectState.WRITING
_READY = ObjectState.READY


class SkippedWrites:
    """Counts of writes that a reservation of the same key made L1 skip or take over;
    the caller of each method holds the L1 lock."""

    def __init__(self) -> None:
        self.lost = 0  # skipped writes whose reservation ended uncommitted
        self.loads_taken_over = 0
        self._lost_log = BurstLog(logger, "l1_skipped_writes_lost", level=logging.ERROR)
        self._taken_over_log = BurstLog(logger, "l1_load_taken_over_by_write")

    def reservations_ended(self, objs: Iterable[L1Object], how: str) -> None:
        """Writer reservations ``objs`` leave L1 uncommitted (``how``: aborted, expired):
        the writes skipped behind them are lost."""
        lost = sum(obj.skipped_writes for obj in objs)
        if lost:
            self.lost += lost
            self._lost_log.event(
                lost,
                f"acknowledged writes lost: skipped behind another writer's reservation of "
                f"the same key, which was {how} uncommitted",
            )

    def loads_given_way(self, count: int) -> None:
        if count:
            self.loads_taken_over += count
            self._taken_over_log.event(
                count, "loads from L2 gave way to a client's write of the same key (a miss for their reader)"
            )

    def counts(self) -> dict[str, int]:
        counts = {"l1_skipped_writes_lost": self.lost, "l1_load_taken_over_by_write": self.loads_taken_over}
        return {reason: count for reason, count in counts.items() if count}


class WriteReservations:
    """Reserving, finishing and aborting writes; every method takes the L1 lock."""

    def __init__(
        self,
        lock: threading.RLock,
        table: ObjectTable,
        allocator: ExtentAllocator,
        leases: ExtentLeases,
        skipped: SkippedWrites,
        *,
        lock_ttl_s: float,
        write_ttl_s: float,
    ) -> None:
        self._lock = lock
        self._table = table
        self._allocator = allocator
        self._leases = leases
        self._skipped = skipped
        self.lock_ttl_s = lock_ttl_s
        self.write_ttl_s = write_ttl_s

    def reserve(
        self,
        keys: Sequence[ObjectKey],
        sizes: Sequence[int],
        *,
        temporary: bool,
        layouts: Sequence[str] | None,
        load: bool = False,
    ) -> dict[ObjectKey, L1Object]:
        """``L1Manager.reserve_write`` (``reserve_load`` with ``load``): the new keys, all or
        nothing.  A writer takes over keys a load has reserved (see the module docstring)."""
        if len(keys) != len(sizes):
            raise ValueError(f"{len(keys)} keys but {len(sizes)} sizes")
        if layouts is not None and len(layouts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(layouts)} layouts")
        with self._lock:
            table = self._table
            table.check_open()
            loads: list[L1Object] = []  # load reservations this writer takes over
            writing: dict[ObjectKey, L1Object] = {}  # other writers' reservations it skips
            # The usual store names fresh keys, each once: sorted out by C loops (the chunks
            # of a 256 KiB store paid ~0.2 us each for the loop below, on the thread
            # that serves every client).
            wanted = dict(zip(keys, sizes, strict=True))
            if len(wanted) == len(keys) and table.objects.keys().isdisjoint(keys):
                wanted_layouts = list(layouts) if layouts is not None else [""] * len(keys)
            else:
                wanted, wanted_layouts = self._sort_out(keys, sizes, layouts, load, loads, writing)
            if not wanted:
                self._skip(writing)
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
            # Only once the room is found: a refused reservation leaves the loads running.
            self._skip(writing)
            if loads:
                table.free(loads)  # their extents are held until the prefetch lets go
                self._skipped.loads_given_way(len(loads))
            deadline = time.monotonic() + self.write_ttl_s
            # A batch holds a few distinct sizes (a request's chunks share one): each rounded once.
            extent_of = {size: allocator.extent_size(size) for size in set(wanted.values())}
            # Every field up to ``extent_bytes`` by position: a keyword costs each object
            # more than the rest of its construction's argument passing.
            reserved = {
                key: L1Object(key, offset, size, temporary, _WRITING, 0, deadline, layout, extent_of[size])
                for (key, size), offset, layout in zip(wanted.items(), offsets, wanted_layouts, strict=True)
            }
            table.insert_many(reserved, temporary)
            return reserved

    def _sort_out(
        self,
        keys: Sequence[ObjectKey],
        sizes: Sequence[int],
        layouts: Sequence[str] | None,
        load: bool,
        loads: list[L1Object],
        writing: dict[ObjectKey, L1Object],
    ) -> tuple[dict[ObjectKey, int], list[str]]:
        """The keys of ``reserve`` to reserve with their sizes, a repeated key once at its
        first size, and their layouts in that order; adds the loads it takes over to ``loads``, the writers'
        reservations it skips to ``writing``.  The caller holds the lock."""
        present_of = self._table.objects.get
        wanted: dict[ObjectKey, int] = {}
        wanted_layouts: list[str] = []
        for position, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            if key in wanted:
                continue
            present = present_of(key)
            if present is not None:
                if load or present.state is not _WRITING:
                    continue
                if not present.loading:
                    writing[key] = present
                    continue
                loads.append(present)
            wanted[key] = size
            wanted_layouts.append(layouts[position] if layouts is not None else "")
        return wanted, wanted_layouts

    @staticmethod
    def _skip(writing: dict[ObjectKey, L1Object]) -> None:
        """A writer was told these keys are there: it counts on their reservations."""
        for obj in writing.values():
            obj.skipped_writes += 1

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
        made: list[L1Object] = []
        table = self._table
        locked = table.locked
        writing = table.deadlines.writing
        unlocked_bytes = 0
        # On the grid, as every read lock's; only read-locked objects take it.
        deadline = read_lock_deadline(time.monotonic(), self.lock_ttl_s) if read_count else 0.0
        for obj in objs:
            if obj is None or obj.state is not _WRITING or obj.loading is not loads:
                done.append(False)
                continue
            obj.loading = False
            obj.state = _READY  # in the loop: a key repeated in ``objs`` is refused the second time
            del writing[obj]
            obj.read_locks = read_count
            # Never the write deadline left behind: a READY object's ``lock_deadline`` equal
            # to a lookup's grid deadline says it is filed under that deadline's cell
            # (``ReadLocks.lock_prefix``), and a write deadline may fall on the grid.
            obj.lock_deadline = deadline
            if not read_count:
                del locked[obj.key]
                unlocked_bytes += obj.extent_bytes
            made.append(obj)
            done.append(True)
        table.writes_ended(unlocked_bytes)
        if read_count and made:
            table.deadlines.reading(deadline).update(made)
        table.index_ready(made)
        table.listeners.notify("written", [obj.key for obj in made])
        return done

    def finish_reserved(self, reserved: Mapping[ObjectKey, L1Object]) -> list[L1Object]:
        """A writer's reservations that are still the objects of their keys (``reserved`` as
        ``reserve`` returned it): READY, not read-locked; returns those objects.  A
        reservation reaped at the write TTL may be another writer's by now, whose bytes are
        not there yet: it is left alone."""
        with self._lock:
            get = self._table.objects.get
            own = list(reserved.values())
            # The usual commit: every reservation is still its key's object, which C loops
            # tell without a Python step per key (the loop thread commits every client's).
            if not all(map(operator.is_, map(get, reserved), own)):
                own = [obj for key, obj in reserved.items() if get(key) is obj]
            if not own:
                return []
            self._table.check_open()
            done = self.make_ready(own, 0, loads=False)
            return own if all(done) else [obj for obj, ok in zip(own, done, strict=True) if ok]

    def abort(self, keys: Sequence[ObjectKey]) -> None:
        """Free a writer's reservations of ``keys``; other keys are left alone."""
        with self._lock:
            objects = self._table.objects
            aborted: list[L1Object] = []
            for key in dict.fromkeys(keys):
                obj = objects.get(key)
                if obj is not None and obj.state is _WRITING and not obj.loading:
                    obj.fenced = False  # its writer aborts once its copy stopped
                    aborted.append(obj)
            self._table.free(aborted)
            self._skipped.reservations_ended(aborted, "aborted")
