"""StorageManager: L1, the L2 adapters, the policies and the controllers, wired together.

Front ends talk only to this class.  Writes are reserved in L1, filled by the client and
committed, which queues them for L2; lookups run as prefetches that leave the hit prefix
read-locked in L1 for the reader, who releases it when done.

This module holds the operations front ends call; building, starting and stopping the
parts is ``storage_wiring.py``, the status snapshot ``storage_status.py``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from lmcache_tiers.activity import DATA_PLANE
from lmcache_tiers.burst import BurstLog
from lmcache_tiers.config import ServerConfig
from lmcache_tiers.controllers import aligned_total
from lmcache_tiers.errors import L1OutOfMemoryError, TiersError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Loan, L1Object, ObjectState
from lmcache_tiers.layout import check_layout
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import ComponentRegistry
from lmcache_tiers.storage_status import failure_counts, storage_status
from lmcache_tiers.storage_wiring import StorageCloseFailed, StorageParts, build_policy

__all__ = ["StorageCloseFailed", "StorageManager", "build_policy"]

logger = logging.getLogger(__name__)


class StorageManager:
    """The two-level store behind every front end; thread-safe."""

    def __init__(self, config: ServerConfig, registry: ComponentRegistry | None = None) -> None:
        parts = StorageParts(config, registry if registry is not None else load_registry())
        self.config = config
        self.l1 = parts.l1
        self.adapters = parts.adapters
        self.stats = parts.stats
        self.l1_eviction = parts.l1_eviction
        self.store = parts.store
        self.prefetch = parts.prefetch
        self.l2_evictions = parts.l2_evictions
        self._parts = parts
        self._closed = False
        self._close_lock = threading.Lock()
        # A mostly locked L1 refuses every write: one line per burst, each one counted.
        self._refusals = BurstLog(logger)
        try:
            parts.start()
        except BaseException:
            # A thread that cannot start, or a stop signal while they start: the threads
            # already running would keep L1 (and its segment) and the adapters alive.
            # Each failing step of that close is logged; the start-up's error is the one
            # to raise.
            self._closed = True
            with contextlib.suppress(StorageCloseFailed):
                parts.close(0.0)
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise TiersError("the storage manager is closed")

    # -- writes --------------------------------------------------------------------------

    def reserve_write(
        self,
        keys: Sequence[ObjectKey],
        sizes: Sequence[int],
        layouts: Sequence[str] | None = None,
    ) -> dict[ObjectKey, L1Object]:
        """Write-lock L1 extents for the keys not yet present; evicts if L1 is full.

        ``layouts`` are the objects' tensor layouts ("" = unknown), checked against their
        sizes and handed to the L2 serde chains.  Raises L1OutOfMemoryError when even
        eviction cannot make room -- before evicting anything when even evicting every
        unlocked object would not be enough (a batch larger than L1, or L1 mostly locked).
        """
        self._check_open()
        if layouts is not None:
            if len(layouts) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(layouts)} layouts")
            # The chunks of a request share a layout and a size: each pair is checked
            # once (the first bad one in the batch is still the one named).
            for layout, size in dict.fromkeys(zip(layouts, sizes, strict=True)):
                check_layout(layout, size)
        try:
            reserved = self.l1.reserve_write(keys, sizes, layouts=layouts)
        except L1OutOfMemoryError as no_room:
            new_sizes = self._new_sizes(keys, sizes)
            room = self._refuse_if_it_cannot_fit(new_sizes)
            self._refuse_if_no_span_fits(new_sizes, room, no_room)
            reserved = self._evict_until_reserved(keys, sizes, layouts, new_sizes, room)
        if self.l1_eviction.above_watermark():
            self.l1_eviction.wake()
        # The client copies into the reservation until it commits: write-back waits.
        DATA_PLANE.begin_many(reserved)
        return reserved

    def _refuse_if_no_span_fits(
        self, new_sizes: dict[ObjectKey, int], room: int, no_room: L1OutOfMemoryError
    ) -> None:
        """Evicting for a write whose objects fit in no spans that evicting every unlocked
        object would leave (locked objects lie between) would only empty L1 for nothing.

        The ``room`` eviction can give lies in at most one span more than the extents no
        eviction frees, each span wasting less than one of the largest objects: when the
        objects and that many more of the largest fit in it, they fit for sure.  Only an
        L1 so locked that this does not settle it is scanned (every unevictable extent,
        listed under the L1 lock, then read and sorted: O(locked), too slow for every write)."""
        align = self.config.l1_align_bytes
        extents = sorted((aligned_total([size], align) for size in new_sizes.values()), reverse=True)
        if not extents or extents[0] * (len(extents) + self.l1.unevictable_extents() + 1) <= room:
            return
        spans = self.l1.reclaimable_spans()
        short = _objects_no_spans_hold(extents, spans)
        if short is None:
            return
        size, count, held = short
        self._refuse_before_evicting(
            "l1_write_oom",
            f"{no_room}; the spans eviction can free (locked objects lie between them; the widest "
            f"is {max(spans, default=0)} bytes) hold only {held} of its {count} objects of {size} "
            "bytes or more",
        )

    def _evict_until_reserved(
        self,
        keys: Sequence[ObjectKey],
        sizes: Sequence[int],
        layouts: Sequence[str] | None,
        new_sizes: dict[ObjectKey, int],
        room: int,
    ) -> dict[ObjectKey, L1Object]:
        """Evict for a write L1 had no room for, then reserve it.

        The write's size is that of the objects it reserves (``new_sizes``): a batch whose
        keys are mostly in L1 already needs the room of its new ones only, and evicting
        the whole batch's size would throw out that much of L1 for nothing.  Evicting it
        frees that many bytes, but maybe in pieces none of which holds one of its objects
        (fragmentation): eviction goes on, the write's size at a time in the policy's
        order, until the write fits or a round frees nothing.  Or
        until the rounds have freed the ``room`` evicting every unlocked object gave when
        the write began: other writers took the room freed since (between a round and the
        reservation), and evicting on would only go on as long as they write.
        """
        need = aligned_total(new_sizes.values(), self.config.l1_align_bytes)
        evicted = 0
        while True:
            freed = self.l1_eviction.evict_now(need)
            evicted += freed
            try:
                return self.l1.reserve_write(keys, sizes, layouts=layouts)
            except L1OutOfMemoryError:
                if freed <= 0 or evicted >= room:
                    self.stats.fail("l1_write_oom")
                    raise

    def commit_write(self, keys: Sequence[ObjectKey], *, to_l2: bool = True) -> list[bool]:
        """Make reserved objects READY and queue them for L2 (unless ``to_l2`` is False:
        L1-only objects); False for keys not reserved.

        From their commit until their L2 stores settle, the objects are evicted only when
        nothing else can make room for a write, and counted then
        (``evicted_before_l2_store``).
        """
        self._check_open()
        with self.l1.lock:  # no eviction between the commit and the unstored flag
            done = self.l1.finish_write(keys)
            committed = [key for key, ok in zip(keys, done, strict=True) if ok]
            queued = to_l2 and self.store.queue(committed)
        self._after_commit(keys, len(committed), queued)
        return done

    def _after_commit(self, keys: Sequence[ObjectKey], committed: int, queued: bool) -> None:
        """A commit's reports, once the L1 lock is let go: woken under it, the store
        controller would wait for that lock straight away."""
        if queued:
            self.store.wake()
        DATA_PLANE.end_many(keys)
        self.stats.add("keys_written", committed)

    def abort_write(self, keys: Sequence[ObjectKey]) -> None:
        self.l1.abort_write(keys)
        DATA_PLANE.end_many(keys)

    def commit_reserved(
        self, reserved: Mapping[ObjectKey, L1Object], *, to_l2: bool = True
    ) -> list[ObjectKey]:
        """``commit_write`` of the keys whose L1 object is still the one ``reserve_write``
        gave for them; returns the keys committed.  Commits go by key, and a reservation
        L1 reaped during a copy (past the write TTL) may be another writer's by now, whose
        bytes are not there yet: it is left alone.  Checked under the lock reaping takes."""
        with self.l1.lock:  # no eviction between the commit and the unstored flag
            if self._closed and self._still_reserved(reserved):
                self._check_open()  # as commit_write: refused once closed, if anything is left
            # One pass over the reservations, by object: no look-up of each key per step.
            finished = self.l1.finish_reserved(reserved)
            # Every reservation committed (the usual case): its keys as they are, no step per key.
            committed = list(reserved) if len(finished) == len(reserved) else [obj.key for obj in finished]
            queued = to_l2 and self.store.queue(committed)
        # A key still reserved but not committed is one committed before, whose span
        # ended then: ending the committed keys' spans ends every span this call owns.
        if committed:
            self._after_commit(committed, len(committed), queued)
        return committed

    def abort_reserved(self, reserved: Mapping[ObjectKey, L1Object]) -> None:
        """``abort_write`` of the keys whose L1 object is still the one reserved for them
        (another writer's reservation of a key L1 reaped is left alone)."""
        with self.l1.lock:
            self.abort_write(self._still_reserved(reserved))

    def _still_reserved(self, reserved: Mapping[ObjectKey, L1Object]) -> list[ObjectKey]:
        get = self.l1.get
        return [key for key, obj in reserved.items() if get(key) is obj]

    def _new_sizes(self, keys: Sequence[ObjectKey], sizes: Sequence[int]) -> dict[ObjectKey, int]:
        """The sizes of the keys a write reserves, a key repeated in the batch once, at its
        first size: those not in L1 yet, and those a prefetch is loading from L2 -- the
        write takes them over in extents of its own, the load's staying held until the
        prefetch lets go (``l1/writes.py``)."""
        new_sizes: dict[ObjectKey, int] = {}
        with self.l1.lock:  # one hold for the batch, not one per key
            for key, size in zip(keys, sizes, strict=True):
                if key not in new_sizes and _reserved_anew(self.l1.get(key)):
                    new_sizes[key] = size
        return new_sizes

    def _refuse_if_it_cannot_fit(self, new_sizes: dict[ObjectKey, int]) -> int:
        """Evicting for a batch that cannot fit anyway would only empty L1 for nothing.
        Returns the room eviction can give (free and unlocked bytes)."""
        need = aligned_total(new_sizes.values(), self.config.l1_align_bytes)
        room = self.l1.reclaimable_bytes()
        if need <= room:
            return room
        capacity = self.l1.capacity_bytes
        # All of L1 too small is another mistake (chunks sized for a larger L1) than L1
        # held by readers and writers.
        why = (
            f"L1 holds only {capacity}"
            if need > capacity
            else f"at most {room} of {capacity} can be made free (the rest is locked or being written)"
        )
        self._refuse_before_evicting(
            "l1_write_cannot_fit",
            f"a store of {len(new_sizes)} new objects needs {need} bytes of L1, but {why}",
        )

    def _refuse_before_evicting(self, reason: str, why: str) -> NoReturn:
        """Refuse a write that no eviction can fit: counted under ``reason``, logged (one
        line per burst of them, per reason)."""
        self.stats.fail(reason)
        message = f"{why}: refused without evicting anything"
        self._refusals.warn(reason, "%s (failure reason %s)", message, reason)
        raise L1OutOfMemoryError(message) from None

    # -- lookups and reads ---------------------------------------------------------------

    def submit_prefetch(self, keys: Sequence[ObjectKey], *, readers: int = 1) -> int:
        """Start finding the longest cached prefix of ``keys``; returns a handle.

        The prefix found (L1 hits and objects loaded from L2) is read-locked ``readers``
        times; each reader calls ``release`` for it when done.
        """
        self._check_open()
        return self.prefetch.submit(keys, readers)

    def start_prefetch(
        self, keys: Sequence[ObjectKey], *, readers: int = 1, owner_expires: bool = False
    ) -> tuple[int, list[ObjectKey] | None]:
        """``submit_prefetch`` for a caller about to ask for the result anyway (a front end
        answering a lookup): ``(handle, locked)`` when the prefetch finished at once, which
        is the case whenever nothing is left for L2 -- every key in L1, or every adapter
        answered from memory (``lookup_and_lock_now``) that it holds none of the rest --;
        ``locked`` is the read-locked prefix
        (its length is the hit count; release it like any prefetched prefix).  Otherwise
        ``(handle, None)``, and the result comes from ``query_prefetch``/``wait_prefetch``.

        ``owner_expires``: the caller gives the result back itself (``discard_prefetch``)
        when its own deadline passes, and counts that, so the storage keeps it until then
        rather than expiring it at the result TTL -- the caller would find it gone, and
        count again a result the storage counted.
        """
        if self._closed:  # ``_check_open``, without a call on every lookup
            self._check_open()
        return self.prefetch.begin(keys, readers, owner_expires=owner_expires)

    def query_prefetch(self, handle: int) -> int | None:
        """Prefix hit count (L1 + L2) once done, None while running.

        The result is delivered once; later queries and unknown handles answer 0.
        """
        return self.prefetch.query(handle)

    def wait_prefetch(self, handle: int, timeout: float) -> int | None:
        """Like ``query_prefetch`` but waits up to ``timeout`` s; None if still running."""
        return self.prefetch.wait(handle, timeout)

    def discard_prefetch(self, handle: int) -> None:
        """The caller will never ask for ``handle``'s result: the read locks it holds are
        released now, or when it finishes.  A result nobody queries is given back anyway
        after half the L1 lock TTL (counted as ``prefetch_result_expired``)."""
        self.prefetch.discard(handle)

    def read(self, keys: Sequence[ObjectKey], *, generations: list[int] | None = None) -> list[L1Object]:
        """Read-lock and return the READY prefix of ``keys`` (release it with ``release``);
        ``generations``, when given, receives their extents' generations, read with the
        locks taken (``L1Manager.reserve_read_prefix``)."""
        self._check_open()
        objects = self.l1.reserve_read_prefix(keys, generations=generations)
        self.stats.add("keys_read", len(objects))
        return objects

    def view(self, obj: L1Object) -> memoryview:
        """The bytes of a reserved or read-locked object, in the L1 arena (memory L1 only)."""
        return self.l1.view(obj)

    def lend(self, obj: L1Object, *, fill: bool = False) -> L1Loan:
        """A locked object's bytes for copying out (or, ``fill``, in), for every L1 backing:
        see :meth:`L1Manager.lend`."""
        return self.l1.lend(obj, fill=fill)

    def read_object(self, obj: L1Object, out: memoryview) -> None:
        """Copy a read-locked object's bytes into ``out``; works for every L1 backing."""
        self.l1.read_object(obj, out)

    def write_object(self, obj: L1Object, data: memoryview) -> None:
        """Fill a reserved object with exactly its size in bytes; works for every L1 backing."""
        self.l1.write_object(obj, data)

    def release(self, keys: Sequence[ObjectKey], count: int = 1, *, not_before: float | None = None) -> None:
        """Drop ``count`` read locks per key (from ``read`` or a prefetch).

        ``not_before`` is a lower bound on the deadlines of the locks released:
        ``l1.lock_deadline(t)`` of a ``time.monotonic()`` value ``t`` read before they were
        taken.  Given it, L1 drops the caller's locks and not ones another holder forgot
        (which then expire at their own deadline); without it, a forgotten lock may go in
        place of the caller's, which then lives on until its deadline
        (``L1Manager.finish_read``)."""
        if not self._closed:
            self.l1.finish_read(keys, count, not_before=not_before)

    def clear(self, *, force: bool = False) -> int:
        """Delete L1 objects (unlocked ones unless ``force``); returns how many.

        Objects whose L2 store has not started yet go too -- a clear empties L1 -- but
        not silently: they are counted (``l1_cleared_before_l2_store``) and logged, also
        those of a clear that raised part-way.  Those whose store is running still reach
        L2: they are not counted.  The L1 lock is not
        held around the clear, which lets go of it between batches so that stores and
        lookups are served during a long clear (``L1Manager.clear``).
        """
        self._check_open()
        # Judged by L1 as each object goes: a forced clear also takes objects an L2 store
        # is reading now (``storing``), whose extents stay until that store reports, which
        # counts it if it fails or is abandoned at shutdown.
        cleared_unstored: list[L1Object] = []
        try:
            return self.l1.clear(force=force, cleared_unstored=cleared_unstored)
        finally:
            # Also when a later batch raised: the earlier ones' objects are gone for good.
            self._count_cleared_unstored(len(cleared_unstored))

    def _count_cleared_unstored(self, dropped: int) -> None:
        """Count and log the acknowledged writes a clear took before their L2 store."""
        if dropped:
            self.stats.fail("l1_cleared_before_l2_store", dropped)
            logger.warning(
                "clear removed %d objects from L1 before their L2 store: those acknowledged "
                "writes are in no tier now",
                dropped,
            )

    def evict(self, keys: Sequence[ObjectKey]) -> int:
        """Delete ``keys`` from L1 now; L2 copies stay. Returns how many.

        Locked objects are skipped, and so are objects whose L2 store has not happened yet:
        L1 holds their only copy, and dropping an acknowledged write on request is still
        dropping it.
        """
        self._check_open()
        with self.l1.lock:
            objects = [(key, self.l1.get(key)) for key in keys]
            settled = [key for key, obj in objects if obj is not None and not obj.unstored]
            return sum(self.l1.delete(settled))

    # -- operations ----------------------------------------------------------------------

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until committed writes are stored in L2, evictions have caught up and
        prefetches have ended -- the lookups and loads of those given up at their result
        deadline included, since a load still fills (and holds) its L1 reservations until
        its adapter reports.

        Returns False if ``timeout`` passed first (an adapter hung in a call, say).  For
        tests, benchmarks and shutdown scripts; serving never needs it.
        """
        return self._parts.wait_idle(timeout)

    def status(self) -> dict[str, Any]:
        """JSON-able snapshot: usage, counters, in-flight work and failures."""
        return storage_status(self._parts)

    def failures(self) -> dict[str, int]:
        """The failures of :meth:`status`, by reason, without asking the adapters (also
        once closed)."""
        return failure_counts(self._parts)

    def close(self, drain_timeout_s: float = 10.0) -> None:
        """Finish in-flight L2 work (up to ``drain_timeout_s``), stop every thread, close
        the adapters and release L1.  Idempotent.

        Every step runs whatever an earlier one raised; :class:`StorageCloseFailed` then
        names the steps that failed (each logged with its traceback)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._parts.close(drain_timeout_s)

    def __enter__(self) -> StorageManager:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        if exc_type is None:
            self.close()
            return
        # What ended the block (a Ctrl-C, SIGTERM's SystemExit in a replay, a failed call)
        # is the one to raise: close steps failing on top are logged and counted by the
        # close already, and must not replace it (nor the exit status it carries).
        with contextlib.suppress(StorageCloseFailed):
            self.close()


def _reserved_anew(present: L1Object | None) -> bool:
    """Whether a write of a key whose L1 object is ``present`` reserves an extent for it:
    none there, or a load's reservation it takes over (as ``L1Manager.reserve_write``)."""
    return present is None or (present.state is ObjectState.WRITING and present.loading)


def _objects_no_spans_hold(extents: list[int], spans: list[int]) -> tuple[int, int, int] | None:
    """``(size, count, held)`` for the largest size of ``extents`` (aligned, largest first)
    whose ``count`` objects of that size or more are more than the ``spans`` can hold (a
    span of ``g`` bytes holds ``g // size`` of them at most: ``held`` in all); None if
    there is no such size.  Exact for a batch of one size (a request's chunks), a
    necessary condition for others: a write is refused only when it cannot fit."""
    for count, size in enumerate(extents, 1):
        if count < len(extents) and extents[count] == size:
            continue  # judged at the last object of this size
        held = sum(span // size for span in spans)
        if held < count:
            return size, count, held
    return None
