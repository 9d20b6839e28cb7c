"""Prefetch controller: brings the L2 part of a prompt's prefix into L1 for a reader.

One request goes through::

    submit   L1 prefix check; the L1 hits are read-locked for the reader at once
    start    (when a slot is free) lookup-and-lock on every adapter for the remaining keys
    plan     prefetch policy picks a source per key; the plan is trimmed to its contiguous
             prefix and L1 extents are reserved (evicting, or loading fewer, if L1 is full)
    phase 1  pins of keys that will not be loaded are dropped, loads are submitted
    phase 2  each load's pins are dropped when its result arrives
    hand-off loaded objects become READY and read-locked in one step; failed keys and
             everything after the first gap are freed; the hit count is L1 hits plus the
             contiguous prefix actually loaded
    result   kept, with the prefix's read locks, until the owner claims it (or gives it
             back: see prefetch_results.py)

Every L1 lock and L2 pin a request takes is released on every path: success, adapter
failure, policy error and shutdown.  The L1 objects a request loads into are reserved as
loads (``L1Manager.reserve_load``) and finished or freed by object identity, so a failed
load's bytes never become readable, nor reach the store controller as a fresh write.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from lmcache_tiers.controllers.base import AdapterSlot, ControllerThread, TaskTracker, aligned_total
from lmcache_tiers.controllers.prefetch_results import HeldResult, PrefetchResults
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Loan, L1Manager, L1Object
from lmcache_tiers.l2.interface import L2Op, LookupResult
from lmcache_tiers.policies import PrefetchPolicy

logger = logging.getLogger(__name__)

#: results waiting for their owners beyond this many are given back, oldest first
MAX_UNCLAIMED_RESULTS = 1 << 16


@dataclass(eq=False)
class _Request:
    handle: int
    keys: list[ObjectKey]
    readers: int
    l1_hits: int  # leading keys read-locked ``readers`` times
    result_deadline: float  # the result is given back if not claimed by then
    remaining: list[ObjectKey] = field(default_factory=list)  # keys[l1_hits:] at start
    lookups: dict[int, int] = field(default_factory=dict)  # adapter index -> task id
    found: dict[int, LookupResult] = field(default_factory=dict)  # adapter index -> result
    pinned: dict[int, list[ObjectKey]] = field(default_factory=dict)  # pins not yet dropped
    # hand-off candidates: prefix of ``remaining``; per key, the adapter index it loads
    # from, or None for a key found READY in L1 meanwhile (read-locked like a hit)
    sources: list[int | None] = field(default_factory=list)
    reserved: dict[ObjectKey, L1Object] = field(default_factory=dict)  # write-locked
    loads: dict[int, int] = field(default_factory=dict)  # adapter index -> task id
    loaded: set[ObjectKey] = field(default_factory=set)


@dataclass(eq=False)
class _Load:
    request: _Request
    keys: list[ObjectKey]
    objects: list[L1Object]  # reserved as loads, one per key
    loans: list[L1Loan]  # what the adapter fills, one per key; committed on success


class PrefetchController(ControllerThread):
    """Thread that runs prefetch requests, at most ``max_in_flight`` at a time."""

    def __init__(
        self,
        l1: L1Manager,
        slots: Sequence[AdapterSlot],
        policy: PrefetchPolicy,
        stats: EngineStats,
        *,
        max_in_flight: int,
        evict: Callable[[int], int],
        align: int,
        result_ttl_s: float,
    ) -> None:
        super().__init__("l2-prefetch")
        self.l1 = l1
        self.slots = list(slots)
        self.policy = policy
        self.stats = stats
        self.max_in_flight = max_in_flight
        self._evict = evict
        self._align = align
        self._handles = itertools.count(1)
        self._lock = threading.Lock()  # guards the queue and the results
        self._done = threading.Condition(self._lock)
        self._queue: deque[_Request] = deque()
        self._queued: set[int] = set()
        self._results = PrefetchResults(
            self._release_read, stats, ttl_s=result_ttl_s, limit=MAX_UNCLAIMED_RESULTS
        )
        self._closed = False  # set once the thread is done: submits complete at once
        # _active is changed under _lock (queries look at it) by the controller thread only
        self._active: dict[int, _Request] = {}
        # controller thread only:
        self._claimed: Counter[ObjectKey] = Counter()  # keys an active request may load
        self._lookups = TaskTracker[_Request, LookupResult](
            L2Op.LOOKUP, lambda adapter: adapter.pop_completed_lookups(), stats
        )
        self._loads = TaskTracker[_Load, list[bool]](
            L2Op.LOAD, lambda adapter: adapter.pop_completed_loads(), stats
        )
        self._fd_routes: dict[int, tuple[AdapterSlot, L2Op]] = {}
        for slot in self.slots:
            self._fd_routes[slot.adapter.event_fd(L2Op.LOOKUP)] = (slot, L2Op.LOOKUP)
            self._fd_routes[slot.adapter.event_fd(L2Op.LOAD)] = (slot, L2Op.LOAD)

    # -- called from other threads -----------------------------------------------------

    def submit(self, keys: Sequence[ObjectKey], readers: int = 1) -> int:
        """Start a prefetch of ``keys`` (prefix order); returns a handle to query."""
        handle, locked = self.begin(keys, readers)
        if locked is not None:
            deadline = time.monotonic() + self._results.ttl_s
            with self._lock:
                self._publish(handle, HeldResult(len(locked), locked, readers, deadline))
        return handle

    def begin(self, keys: Sequence[ObjectKey], readers: int = 1) -> tuple[int, list[ObjectKey] | None]:
        """Like ``submit``, but a prefetch with nothing to do in L2 (every key hit L1, no
        adapter, or shutting down) is answered at once: ``(handle, locked)``, ``locked``
        being the read-locked prefix (L1's own key objects, equal to the caller's), and
        the handle then answers 0 like a collected one.  Otherwise ``(handle, None)``.

        The common lookup (everything in L1) thus costs one pass over L1 and no request
        record, queue, thread wake-up or result to collect.
        """
        if readers < 1:
            raise ValueError(f"readers must be at least 1, got {readers}")
        keys = unique_prefix(keys)
        handle = next(self._handles)
        locked = [obj.key for obj in self.l1.reserve_read_prefix(keys, readers)]
        l1_hits = len(locked)
        remaining = len(keys) - l1_hits
        self.stats.add_many(lookups=1, lookup_keys=len(keys), l1_hit_chunks=l1_hits)
        logger.debug(
            "Prefetch request submitted: %d total keys, %d L1 prefix hits, %d remaining for L2",
            len(keys),
            l1_hits,
            remaining,
        )
        if remaining == 0 or not self.slots:
            return handle, locked
        request = _Request(handle, keys, readers, l1_hits, time.monotonic() + self._results.ttl_s)
        with self._lock:
            # Checked under the lock: once finish() has set it, nothing may be queued.
            if self._closed:
                return handle, locked
            self._queue.append(request)
            self._queued.add(handle)
        self.wake()
        return handle, None

    def query(self, handle: int) -> int | None:
        """Prefix hit count once done (delivered once), None while running, 0 if unknown."""
        with self._lock:
            return self._claim(handle)

    def wait(self, handle: int, timeout: float | None) -> int | None:
        """Like ``query`` but waits up to ``timeout`` seconds; None if still running."""
        with self._lock:
            self._done.wait_for(lambda: self._claim_ready(handle), timeout)
            return self._claim(handle)

    def discard(self, handle: int) -> None:
        """The owner will never claim ``handle``: its read locks are released now, or when
        the prefetch finishes.  Counting why is the owner's business."""
        with self._lock:
            self._results.discard(handle, running=handle in self._queued or self._is_active(handle))

    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    def in_flight(self) -> int:
        return len(self._active)

    def busy(self) -> bool:
        return bool(self._active) or self.queued() > 0

    def _claim_ready(self, handle: int) -> bool:
        return handle in self._results or (handle not in self._queued and not self._is_active(handle))

    def _is_active(self, handle: int) -> bool:
        return handle in self._active

    def _claim(self, handle: int) -> int | None:
        hits = self._results.claim(handle)
        if hits is not None:
            return hits
        if handle in self._queued or self._is_active(handle):
            return None
        return 0

    def _publish(self, handle: int, result: HeldResult) -> None:
        """Record a result; caller holds ``self._lock``."""
        self._results.publish(handle, result)
        self._done.notify_all()

    # -- L1 helpers ----------------------------------------------------------------------

    def _lock_l1_prefix(self, keys: list[ObjectKey], start: int, readers: int) -> int:
        """Read-lock the READY prefix of ``keys[start:]``; returns how many were locked."""
        return len(self.l1.reserve_read_prefix(keys[start:] if start else keys, readers))

    def _release_read(self, keys: list[ObjectKey], readers: int) -> None:
        if keys:
            self.l1.finish_read(keys, readers)

    # -- the thread --------------------------------------------------------------------

    def watched_fds(self) -> Iterable[int]:
        return self._fd_routes

    def step(self, ready_fds: set[int]) -> None:
        routes = (
            list(self._fd_routes.values()) if self.stopping else [self._fd_routes[fd] for fd in ready_fds]
        )
        for slot, op in routes:
            if op is L2Op.LOOKUP:
                self._reap_lookups(slot)
            else:
                self._reap_loads(slot)
        if self.stopping:
            self._cancel_queued()
        else:
            self._start_queued()
        with self._lock:
            self._results.expire(time.monotonic())

    def _start_queued(self) -> None:
        while len(self._active) < self.max_in_flight:
            request = self._next_startable()
            if request is None:
                return
            try:
                self._start(request)
            except Exception:
                self._abandon(request, "prefetch_internal_error")

    def _next_startable(self) -> _Request | None:
        # A request overlapping keys another active request is loading waits for it:
        # started now it would find them write-locked and miss, started later it finds
        # them READY in L1.
        with self._lock:
            for position, request in enumerate(self._queue):
                if not any(key in self._claimed for key in request.keys[request.l1_hits :]):
                    del self._queue[position]
                    self._queued.discard(request.handle)
                    self._active[request.handle] = request
                    return request
        return None

    def _start(self, request: _Request) -> None:
        # Objects that became READY while the request was queued extend its L1 prefix.
        extra = self._lock_l1_prefix(request.keys, request.l1_hits, request.readers)
        if extra:
            request.l1_hits += extra
            self.stats.add("l1_hit_chunks", extra)
        request.remaining = request.keys[request.l1_hits :]
        if not request.remaining:
            self._finish(request, 0)
            return
        self._claimed.update(request.remaining)
        for slot in self.slots:
            try:
                task_id = slot.adapter.submit_lookup_and_lock(request.remaining)
            except Exception as exc:
                self.stats.fail("l2_lookup_submit_error")
                logger.warning("lookup on %s could not be submitted: %s", slot.name, exc)
                continue
            request.lookups[slot.index] = task_id
            self._lookups.track(slot, task_id, request)
            self.stats.add_adapter(slot.index, "lookups")
        if not request.lookups:
            self._finish(request, 0)

    def _reap_lookups(self, slot: AdapterSlot) -> None:
        for request, result in self._lookups.reap(slot):
            try:
                self._lookup_done(slot, request, result)
            except Exception:
                self._abandon(request, "prefetch_internal_error")

    def _lookup_done(self, slot: AdapterSlot, request: _Request, result: LookupResult) -> None:
        count = len(request.remaining)
        if len(result.found) != count or len(result.sizes) != count:
            self.stats.fail("l2_lookup_bad_result")
            result = LookupResult([False] * count, [0] * count)
        request.found[slot.index] = result
        hits = [key for key, hit in zip(request.remaining, result.found, strict=True) if hit]
        request.pinned[slot.index] = hits
        self.stats.add_adapter(slot.index, "keys_found", len(hits))
        del request.lookups[slot.index]
        if not request.lookups:
            self._plan_and_load(request)

    def _plan_and_load(self, request: _Request) -> None:
        keys = request.remaining
        positions = sorted(request.found)
        found = [request.found[index].found for index in positions]
        try:
            plan = self.policy.select_load_plan(keys, found, [self.slots[i].info() for i in positions])
        except Exception:
            logger.exception("prefetch policy failed; treating request %d as an L2 miss", request.handle)
            self.stats.fail("prefetch_policy_error")
            plan = {}
        sources = self._contiguous_sources(keys, plan, request.found)
        reserved = self._reserve(keys[: len(sources)], request, sources)
        request.reserved = reserved
        # Walk the planned prefix: a key L1 could not reserve is usable only if it is
        # READY in L1 by now (another writer beat us to it); the first other key ends it.
        usable: list[int | None] = []
        for key, source in zip(keys, sources, strict=False):
            if key in reserved:
                usable.append(source)
            elif self.l1.reserve_read([key], request.readers):
                usable.append(None)
            else:
                break
        request.sources = usable
        self._abort(request, [key for key in keys[len(usable) : len(sources)] if key in reserved])
        # Phase 1: drop pins of everything that will not be loaded from that adapter.
        to_load: dict[int, list[ObjectKey]] = {}
        for key, usable_source in zip(keys, usable, strict=False):
            if usable_source is not None:
                to_load.setdefault(usable_source, []).append(key)
        for index in list(request.pinned):
            keep = set(to_load.get(index, ()))
            self._unlock(request, index, [key for key in request.pinned[index] if key not in keep])
        for index, load_keys in to_load.items():
            self._submit_load(request, self.slots[index], load_keys)
        if not request.loads:
            self._hand_off(request)

    @staticmethod
    def _contiguous_sources(
        keys: list[ObjectKey], plan: dict[int, list[bool]], found: dict[int, LookupResult]
    ) -> list[int]:
        """Per key of the plan's contiguous prefix, the lowest planned adapter that found it."""
        candidates = sorted(index for index in plan if index in found)
        sources: list[int] = []
        for position in range(len(keys)):
            source = next(
                (
                    index
                    for index in candidates
                    if position < len(plan[index]) and plan[index][position] and found[index].found[position]
                ),
                None,
            )
            if source is None:
                break
            sources.append(source)
        return sources

    def _reserve(
        self, keys: list[ObjectKey], request: _Request, sources: list[int]
    ) -> dict[ObjectKey, L1Object]:
        """Write-lock L1 extents for ``keys``; when L1 is full, evict once, then load fewer."""
        sizes = [request.found[source].sizes[position] for position, source in enumerate(sources)]
        temporary = not self.policy.retain_loaded
        count = len(keys)
        evicted = False
        while count > 0:
            try:
                return self.l1.reserve_load(keys[:count], sizes[:count], temporary=temporary)
            except L1OutOfMemoryError:
                if not evicted:
                    evicted = True
                    self._evict(aligned_total(sizes[:count], self._align))
                    continue
                count //= 2
        if keys:
            self.stats.fail("prefetch_l1_full")
        return {}

    def _submit_load(self, request: _Request, slot: AdapterSlot, keys: list[ObjectKey]) -> None:
        objects = [request.reserved[key] for key in keys]
        try:
            loans = [self.l1.lend(obj, fill=True) for obj in objects]
            task_id = slot.adapter.submit_load(keys, [loan.buffer for loan in loans])
        except Exception as exc:
            self.stats.fail("l2_load_submit_error")
            logger.warning("load of %d keys from %s could not be submitted: %s", len(keys), slot.name, exc)
            self._unlock(request, slot.index, keys)
            return
        request.loads[slot.index] = task_id
        self._loads.track(slot, task_id, _Load(request, keys, objects, loans))
        self.stats.add_adapter(slot.index, "load_tasks_submitted")

    def _reap_loads(self, slot: AdapterSlot) -> None:
        for load, results in self._loads.reap(slot):
            try:
                self._load_done(slot, load.request, load.keys, self._commit_loaded(load, results))
            except Exception:
                self._abandon(load.request, "prefetch_internal_error")

    def _commit_loaded(self, load: _Load, results: list[bool]) -> list[bool]:
        """Make the loaded bytes the objects' own; a commit that fails is a failed load."""
        committed: list[bool] = []
        for key, ok, loan in zip(load.keys, results, load.loans, strict=False):
            if ok:
                try:
                    loan.commit()
                except (KeyError, ValueError, OSError, RuntimeError) as exc:
                    logger.warning("copying loaded %s into L1 failed: %s", key, exc)
                    ok = False
            committed.append(ok)
        return committed

    def _load_done(
        self, slot: AdapterSlot, request: _Request, keys: list[ObjectKey], results: list[bool]
    ) -> None:
        # Phase 2: the bytes are in L1 (or never will be); the pins have done their job.
        self._unlock(request, slot.index, keys)
        loaded = [key for key, ok in zip(keys, results, strict=False) if ok]
        request.loaded.update(loaded)
        self.stats.add_adapter(slot.index, "keys_loaded", len(loaded))
        if len(loaded) < len(keys):
            self.stats.add_adapter(slot.index, "keys_load_failed", len(keys) - len(loaded))
            self.stats.fail("l2_load_failed", len(keys) - len(loaded))
        del request.loads[slot.index]
        if not request.loads:
            self._hand_off(request)

    def _hand_off(self, request: _Request) -> None:
        """Turn the loaded prefix into read-locked READY objects; free everything else."""
        cut = 0
        for key, source in zip(request.remaining, request.sources, strict=False):
            if source is not None and key not in request.loaded:
                break
            cut += 1
        loaded = [
            key
            for key, source in zip(request.remaining[:cut], request.sources, strict=False)
            if source is not None
        ]
        objects = [request.reserved[key] for key in loaded]
        handed = self.l1.finish_load(objects, request.readers) if objects else []
        # An object that vanished before the hand-off (TTL expiry, forced clear) ends the
        # prefix there too.
        if not all(handed):
            first_lost = loaded[handed.index(False)]
            cut = request.remaining.index(first_lost)
        handed_keys = {key for key, ok in zip(loaded, handed, strict=True) if ok}
        for key in request.remaining[:cut]:
            request.reserved.pop(key, None)
        # Past the cut: loaded-but-unusable objects are freed, L1 hits are unlocked.
        tail = request.remaining[cut : len(request.sources)]
        self._release_read(
            [
                key
                for key, source in zip(tail, request.sources[cut:], strict=False)
                if source is None or key in handed_keys
            ],
            request.readers,
        )
        self._abort(request, list(request.reserved))
        l2_hits = sum(1 for source in request.sources[:cut] if source is not None)
        self.stats.add("l2_hit_chunks", l2_hits)
        self.stats.add("l1_hit_chunks", cut - l2_hits)
        self._finish(request, cut)

    def _abort(self, request: _Request, keys: list[ObjectKey]) -> None:
        if keys:
            self.l1.abort_load([request.reserved.pop(key) for key in keys])

    def _unlock(self, request: _Request, index: int, keys: list[ObjectKey]) -> None:
        if not keys:
            return
        dropped = set(keys)
        request.pinned[index] = [key for key in request.pinned.get(index, ()) if key not in dropped]
        self._unlock_slot(self.slots[index], keys)

    def _unlock_slot(self, slot: AdapterSlot, keys: list[ObjectKey]) -> None:
        if not keys:
            return
        try:
            slot.adapter.unlock(keys)
        except Exception as exc:
            self.stats.fail("l2_unlock_error")
            logger.warning("unlock of %d keys on %s failed: %s", len(keys), slot.name, exc)

    def _finish(self, request: _Request, l2_prefix: int) -> None:
        """Publish the result and forget the request (all its locks are settled)."""
        if request.remaining:
            self._claimed.subtract(request.remaining)
            for key in request.remaining:
                if self._claimed[key] <= 0:
                    del self._claimed[key]
        hits = request.l1_hits + l2_prefix
        result = HeldResult(hits, request.keys[:hits], request.readers, request.result_deadline)
        with self._lock:
            # Leaving _active and publishing under one lock: a query in between must not
            # mistake the handle for an unknown one.
            self._active.pop(request.handle, None)
            self._publish(request.handle, result)

    def _abandon(self, request: _Request, reason: str) -> None:
        """Give up on a request (shutdown, or an unexpected error) and release what it holds.

        Objects a running load is still filling are freed only when that load reports:
        freeing them now could hand their extents to new objects while the adapter still
        writes into them.  Lookups still running have their pins dropped when they report.
        """
        logger.log(
            logging.ERROR if reason == "prefetch_internal_error" else logging.WARNING,
            "prefetch request %d abandoned (%s)",
            request.handle,
            reason,
            exc_info=reason == "prefetch_internal_error",
        )
        self.stats.fail(reason)
        for index, task_id in request.lookups.items():
            self._lookups.orphan(index, task_id, self._settle_orphan_lookup)
        loading: set[ObjectKey] = set()
        for index, task_id in request.loads.items():
            load = self._loads.orphan(index, task_id, self._settle_orphan_load)
            if load is not None:
                loading.update(load.keys)
        request.lookups.clear()
        request.loads.clear()
        for index in list(request.pinned):
            self._unlock(request, index, [key for key in request.pinned[index] if key not in loading])
        self._abort(request, [key for key in request.reserved if key not in loading])
        found_in_l1 = [
            key for key, source in zip(request.remaining, request.sources, strict=False) if source is None
        ]
        self._release_read(request.keys[: request.l1_hits] + found_in_l1, request.readers)
        request.l1_hits = 0
        self._finish(request, 0)

    def _settle_orphan_lookup(self, slot: AdapterSlot, request: _Request, result: LookupResult) -> None:
        # The abandoned request will not load them: drop the pins the lookup took.
        found = result.found
        self._unlock_slot(slot, [key for key, hit in zip(request.remaining, found, strict=False) if hit])

    def _settle_orphan_load(self, slot: AdapterSlot, load: _Load, results: list[bool]) -> None:
        # The adapter is done with the buffers: the objects can be freed, the pins dropped.
        self._unlock_slot(slot, load.keys)
        self.l1.abort_load(load.objects)

    # -- shutdown ------------------------------------------------------------------------

    def _cancel_queued(self) -> None:
        with self._lock:
            cancelled = list(self._queue)
            self._queue.clear()
            self._queued.clear()
        for request in cancelled:
            self._release_read(request.keys[: request.l1_hits], request.readers)
            with self._lock:
                self._publish(request.handle, HeldResult(0, [], request.readers, request.result_deadline))

    def finish(self) -> None:
        """Release what requests that did not drain in time still hold."""
        with self._lock:
            self._closed = True
        self._cancel_queued()
        for request in list(self._active.values()):
            self._abandon(request, "prefetch_abandoned")


def unique_prefix(keys: Sequence[ObjectKey]) -> list[ObjectKey]:
    """``keys`` up to the first repeat: a real prefix never holds the same chunk twice,
    and a repeat would make one L1 object stand for two positions."""
    if len(set(keys)) == len(keys):
        return list(keys)  # the usual case, decided in C
    seen: set[ObjectKey] = set()
    for position, key in enumerate(keys):
        if key in seen:
            return list(keys[:position])
        seen.add(key)
    return list(keys)
