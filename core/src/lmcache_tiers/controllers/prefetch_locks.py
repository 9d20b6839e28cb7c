"""What a prefetch takes and gives back: L1 read locks on its prefix, L1 load
reservations for the keys it loads, and the pins its lookups took on the adapters.

Each request's record (``prefetch_requests.py``) says what it holds; :class:`PrefetchLocks`
takes and releases those holds, keeping the record in step, so that every path through
the controller -- success, adapter failure, policy error, shutdown -- gives all of it back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.controllers.base import AdapterSlot, aligned_total
from lmcache_tiers.controllers.prefetch_requests import PrefetchRequest
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object
from lmcache_tiers.l2.interface import LookupResult

logger = logging.getLogger(__name__)


class PrefetchLocks:
    """L1 locks and adapter pins of prefetch requests; used by the controller thread, except
    :meth:`release_read`, which front ends reach through results they give back."""

    def __init__(
        self,
        l1: L1Manager,
        slots: Sequence[AdapterSlot],
        stats: EngineStats,
        *,
        evict: Callable[[int], int],
        align: int,
    ) -> None:
        self.l1 = l1
        self.slots = list(slots)
        self.stats = stats
        self._evict = evict
        self._align = align
        self._lost_log = BurstLog(logger, "prefetch_loaded_object_lost")
        self._full_log = BurstLog(logger, "prefetch_l1_full")
        self._busy_log = BurstLog(logger, "prefetch_key_being_written")
        self._unlock_log = BurstLog(logger, "l2_unlock_error")

    # -- L1 read locks -------------------------------------------------------------------

    def lock_l1_prefix(self, keys: list[ObjectKey], start: int, readers: int) -> int:
        """Read-lock the READY prefix of ``keys[start:]``; returns how many were locked."""
        return len(self.l1.reserve_read_prefix(keys[start:] if start else keys, readers))

    def release_read(self, keys: list[ObjectKey], readers: int, not_before: float | None) -> None:
        """Drop ``readers`` locks per key; ``not_before`` is a lower bound on their deadlines
        (``L1Manager.finish_read``), so that locks other holders forgot are not dropped in
        their place."""
        if keys:
            self.l1.finish_read(keys, readers, not_before=not_before)

    # -- L1 load reservations ------------------------------------------------------------

    def reserve_planned(self, request: PrefetchRequest, sources: list[int], *, temporary: bool) -> None:
        """Reserve L1 objects for the planned prefix (``sources``: one adapter per key) and
        settle ``request.reserved`` and ``request.sources``, the usable part of the plan.

        A key L1 could not reserve is usable only if it is READY in L1 by now (another
        writer beat us to it; it is read-locked like a hit); the first other key ends it.
        """
        keys = request.remaining
        reserved, attempted = self._reserve(keys[: len(sources)], request.load_sizes(sources), temporary)
        request.reserved = reserved
        usable: list[int | None] = []
        for position, (key, source) in enumerate(zip(keys, sources, strict=False)):
            if key in reserved:
                usable.append(source)
            elif self.l1.reserve_read([key], request.readers):
                usable.append(None)
            else:
                # Being written by someone else (a client's store, a given-up prefetch's
                # load still running): the hits after it are not the reader's.  A key past
                # those L1 was asked to reserve is one it had no room for, counted as such.
                if position < attempted:
                    self.stats.fail("prefetch_key_being_written")
                    self._busy_log.event(1, "prefetches cut short at a key another writer was filling in L1")
                break
        request.sources = usable
        self.abort(request, [key for key in keys[len(usable) : len(sources)] if key in reserved])

    def _reserve(
        self, keys: list[ObjectKey], sizes: list[int], temporary: bool
    ) -> tuple[dict[ObjectKey, L1Object], int]:
        """Write-lock L1 extents for ``keys``; when L1 is full, evict once, then load fewer.
        Returns the reservations and how many leading keys L1 was asked to reserve."""
        count = len(keys)
        evicted = False
        reserved: dict[ObjectKey, L1Object] = {}
        while count > 0:
            try:
                reserved = self.l1.reserve_load(keys[:count], sizes[:count], temporary=temporary)
                break
            except L1OutOfMemoryError:
                if not evicted:
                    evicted = True
                    self._evict(aligned_total(sizes[:count], self._align))
                    continue
                count //= 2
        if count < len(keys):
            # The hits left out end the prefix the reader gets: a miss it sees, so counted.
            self.stats.fail("prefetch_l1_full")
            self._full_log.event(1, "prefetches found L1 too full to load all of their L2 hits into")
        return reserved, count

    def abort(self, request: PrefetchRequest, keys: list[ObjectKey]) -> None:
        """Free the load reservations of ``keys`` (their loads are over, or never started)."""
        if keys:
            self.l1.abort_load([request.reserved.pop(key) for key in keys])

    def hand_off(self, request: PrefetchRequest, not_before: float | None) -> int:
        """Turn the loaded prefix into read-locked READY objects and free everything else;
        returns how many keys of ``request.remaining`` the prefix reaches.  ``not_before``
        bounds the deadlines of the locks ``request`` took (see :meth:`release_read`)."""
        cut, loaded = request.loaded_prefix()
        objects = [request.reserved[key] for key in loaded]
        layouts = [request.layouts.get(key, "") for key in loaded]
        handed = self.l1.finish_load(objects, request.readers, layouts) if objects else []
        # An object that vanished before the hand-off (TTL expiry, forced clear, or a
        # client's write of its key took it from the load: ``l1/writes.py``) ends the
        # prefix there too.
        if not all(handed):
            first_lost = loaded[handed.index(False)]
            cut = request.remaining.index(first_lost)
            # Loaded from L2 and then lost: a miss the owner sees, so counted like one.
            lost = handed.count(False)
            self.stats.fail("prefetch_loaded_object_lost", lost)
            self._lost_log.event(
                lost,
                "objects loaded from L2 left L1 before their hand-off (write TTL, forced clear, "
                "or a client's write of the key took it from the load)",
            )
        handed_keys = {key for key, ok in zip(loaded, handed, strict=True) if ok}
        for key in request.remaining[:cut]:
            request.reserved.pop(key, None)
        # Past the cut: loaded-but-unusable objects are freed, L1 hits are unlocked.
        tail = request.remaining[cut : len(request.sources)]
        self.release_read(
            [
                key
                for key, source in zip(tail, request.sources[cut:], strict=False)
                if source is None or key in handed_keys
            ],
            request.readers,
            not_before,
        )
        self.abort(request, list(request.reserved))
        return cut

    # -- adapter pins --------------------------------------------------------------------

    def unpin(self, request: PrefetchRequest, index: int, keys: list[ObjectKey]) -> None:
        """Drop the pins ``request`` holds on ``keys`` at adapter ``index``."""
        if not keys:
            return
        request.forget_pins(index, keys)
        self.unpin_slot(self.slots[index], keys)

    def unpin_slot(self, slot: AdapterSlot, keys: list[ObjectKey]) -> None:
        if not keys:
            return
        try:
            slot.adapter.unlock(keys)
        except Exception as exc:
            self.stats.fail("l2_unlock_error")
            # Every request's unlock fails alike: one line per burst per adapter.
            self._unlock_log.warn(
                slot.name,
                "unlock of %d keys on %s failed (failure reason l2_unlock_error): %s: %s",
                len(keys),
                slot.name,
                type(exc).__name__,
                exc,
            )

    def drop_leading_answers(self, request: PrefetchRequest, count: int) -> None:
        """The first ``count`` keys of ``request.remaining`` turned out READY in L1 after
        adapters answered for them at submission: their pins go and the answers shrink to
        the keys still left for L2 (``request.remaining`` is not cut yet)."""
        leading = request.remaining[:count]
        for index, result in list(request.found.items()):
            self.unpin(request, index, [key for key, hit in zip(leading, result.found, strict=False) if hit])
            request.found[index] = LookupResult(result.found[count:], result.sizes[count:])

    def release_pins(self, request: PrefetchRequest) -> None:
        """Drop every pin ``request``'s lookups hold (a queued request given up)."""
        for index in list(request.pinned):
            self.unpin(request, index, list(request.pinned[index]))

    # -- giving up -----------------------------------------------------------------------

    def release_all(
        self, request: PrefetchRequest, loading: dict[int, set[ObjectKey]], not_before: float | None
    ) -> None:
        """Release everything an abandoned request holds, except the reservations of the
        keys still loading and their pins on the adapters loading them (``loading``: keys
        by adapter index), which settle when those loads report.  A loading key's pins on
        its spare adapters go now: nothing settles them later.  ``not_before`` bounds the
        deadlines of its read locks (see :meth:`release_read`)."""
        for index in list(request.pinned):
            busy = loading.get(index, set())
            self.unpin(request, index, [key for key in request.pinned[index] if key not in busy])
        request.spares.clear()
        still_filled = set().union(*loading.values()) if loading else set()
        self.abort(request, [key for key in request.reserved if key not in still_filled])
        self.release_read(
            request.keys[: request.l1_hits] + request.found_in_l1(), request.readers, not_before
        )
        request.l1_hits = 0
