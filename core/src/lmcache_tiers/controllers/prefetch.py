"""Prefetch controller: brings the L2 part of a prompt's prefix into L1 for a reader.

One request goes through::

    submit   L1 prefix check; the L1 hits are read-locked for the reader at once
    start    (when a slot is free) lookup-and-lock on every adapter for the remaining keys
    plan     prefetch policy picks a source per key; the plan is trimmed to its contiguous
             prefix and L1 extents are reserved (evicting, or loading fewer, if L1 is full)
    phase 1  pins of keys that will not be loaded are dropped, loads are submitted
    phase 2  each load's pins are dropped when its result arrives; a key its adapter
             failed to load is loaded again from the next adapter whose lookup found it
             at the same size (its pins there were kept for that), each adapter tried
             once, until one loads it or none is left
    hand-off loaded objects become READY and read-locked in one step; failed keys and
             everything after the first gap are freed; the hit count is L1 hits plus the
             contiguous prefix actually loaded
    result   kept, with the prefix's read locks, until the owner claims it (or gives it
             back: see prefetch_results.py)

Every L1 lock and L2 pin a request takes is released on every path: success, adapter
failure, policy error and shutdown.  The L1 objects a request loads into are reserved as
loads (``L1Manager.reserve_load``) and finished or freed by object identity, so a failed
load's bytes never become readable, nor reach the store controller as a fresh write.

This module is the controller loop; a request's record and the planning that needs no
lock live in ``prefetch_requests.py``, taking and giving back its locks and pins in
``prefetch_locks.py``, and the handles front ends ask about in ``prefetch_handles.py``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.controllers.base import AdapterSlot, ControllerThread, PolicyFailureLog, TaskTracker
from lmcache_tiers.controllers.prefetch_handles import PrefetchHandles
from lmcache_tiers.controllers.prefetch_locks import PrefetchLocks
from lmcache_tiers.controllers.prefetch_requests import (
    PrefetchLoad,
    PrefetchRequest,
    contiguous_sources,
    load_plan,
    unique_length,
    unique_prefix,
)
from lmcache_tiers.controllers.prefetch_results import HeldResult
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.errors import plugin_code
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Loan, L1Manager, L1Object
from lmcache_tiers.l2.interface import L2Op, LookupResult, layouts_of
from lmcache_tiers.policies import PrefetchPolicy

__all__ = ["PrefetchController", "unique_prefix"]

logger = logging.getLogger(__name__)

#: a lookup with this many keys or more past L1's prefix first asks the adapters about the
#: first of them alone (``_missing_everywhere_now``): a new prompt misses there, and the
#: other keys are never asked about; a prompt that hits is asked about the keys after it
PROBE_MIN_KEYS = 8


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
        self._locks = PrefetchLocks(l1, self.slots, stats, evict=evict, align=align)
        self._handles = PrefetchHandles(self._locks.release_read, stats, result_ttl_s=result_ttl_s)
        self._burst = BurstLog(logger)  # bad plans and failing adapter calls: one line a minute each
        self._policy_log = PolicyFailureLog(logger, "prefetch_policy_error")
        self._timed_out = BurstLog(logger, "prefetch_timed_out")
        self._failed_loads = BurstLog(logger, "l2_load_failed")
        self._fallbacks = BurstLog(logger, "l2_load_fallback")
        self._discarded_queued = BurstLog(logger, "prefetch_discarded_queued", level=logging.INFO)
        # controller thread only:
        self._claimed: Counter[ObjectKey] = Counter()  # keys an active request may load
        self._lookups = TaskTracker[PrefetchRequest, LookupResult](
            L2Op.LOOKUP, lambda adapter: adapter.pop_completed_lookups(), stats
        )
        self._loads = TaskTracker[PrefetchLoad, list[bool]](
            L2Op.LOAD, lambda adapter: adapter.pop_completed_loads(), stats
        )
        self._fd_routes: dict[int, tuple[AdapterSlot, L2Op]] = {}
        for slot in self.slots:
            self._fd_routes[slot.adapter.event_fd(L2Op.LOOKUP)] = (slot, L2Op.LOOKUP)
            self._fd_routes[slot.adapter.event_fd(L2Op.LOAD)] = (slot, L2Op.LOAD)

    # -- called from other threads -----------------------------------------------------

    def submit(self, keys: Sequence[ObjectKey], readers: int = 1) -> int:
        """Start a prefetch of ``keys`` (prefix order); returns a handle to query."""
        # Read before ``begin`` takes any lock, as its own start: a lower bound of the
        # deadlines of the locks it takes, and where the result's deadline runs from.
        started = time.monotonic()
        handle, locked = self.begin(keys, readers)
        if locked is not None:
            deadline = started + self._handles.result_ttl_s
            result = HeldResult(len(locked), locked, readers, deadline, self.l1.lock_deadline(started))
            self._handles.publish(handle, result)
        return handle

    def begin(
        self, keys: Sequence[ObjectKey], readers: int = 1, *, owner_expires: bool = False
    ) -> tuple[int, list[ObjectKey] | None]:
        """Like ``submit``, but a prefetch with nothing to do in L2 (every key hit L1, no
        adapter, or shutting down) is answered at once: ``(handle, locked)``, ``locked``
        being the read-locked prefix (the caller's own keys, in order), and
        the handle then answers 0 like a collected one.  Otherwise ``(handle, None)``.

        The common lookup (everything in L1) thus costs one pass over L1 and no request
        record, queue, thread wake-up or result to collect.

        ``owner_expires``: the result is kept until its owner claims or discards it, not
        given back at its deadline (``PrefetchRequest.owner_expires``).
        """
        if readers < 1:
            raise ValueError(f"readers must be at least 1, got {readers}")
        handle = self._handles.new_handle()
        # Read before any lock is taken: L1's lock deadline of it bounds every lock the
        # request takes from below (``PrefetchRequest.not_before``), and its result
        # deadline runs from it.
        started = time.monotonic()
        # The L1 prefix ends at the first repeat, as the unique prefix does: the keys past
        # L1's prefix are deduplicated only when some are left for L2 (rarely, on a hit).
        l1_hits = len(self.l1.reserve_read_prefix(keys, readers, until_repeat=True))
        # (A list's slice is a new list already: no second copy on the usual path.)
        locked = keys[:l1_hits] if type(keys) is list else list(keys[:l1_hits])
        if l1_hits == len(keys):
            # Settled here, as most lookups are: no request record, no log line, and
            # nothing to deduplicate (the prefix ends before a repeat: every key is
            # distinct).
            self.stats.add_lookup(l1_hits, l1_hits)
            return handle, locked
        # Adapters whose answer to the first question (``_missing_everywhere_now``) failed:
        # not asked again at once about the whole lookup (see ``_look_up_now``).
        failed: dict[int, LookupResult | None] = {}
        # The adapters' answers to that question (a hit pinned): those asked about the
        # whole lookup are asked about the keys after that one only (``_look_up_now``).
        probed: dict[int, LookupResult] = {}
        try:
            if not self.slots or len(keys) - l1_hits >= PROBE_MIN_KEYS:
                distinct = unique_length(keys, l1_hits)
                # Settled too: no adapter; a repeat where L1's prefix ends (nothing is left
                # for L2, so no adapter is asked about it); or no adapter holds the first key
                # past L1's prefix, where the prefix then ends -- unless L1 holds it, not
                # READY yet: committed before the request starts, it extends the L1 prefix
                # (``_start``).  Only the number of unique keys is counted.
                if (
                    not self.slots
                    or distinct == l1_hits
                    or (
                        not self.l1.contains(keys[l1_hits])
                        and self._missing_everywhere_now(keys[l1_hits], failed, probed)
                    )
                ):
                    self.stats.add_lookup(distinct, l1_hits)
                    return handle, locked
            answer = self._begin_l2(
                handle, keys, readers, l1_hits, locked, started, failed, probed, owner_expires
            )
        except BaseException:
            for index, probe in probed.items():  # a hit's pin that no request took over
                if probe.found[0]:
                    self._locks.unpin_slot(self.slots[index], [keys[l1_hits]])
            # No request was queued to hold the L1 prefix's read locks, and the caller, who
            # gets the exception instead of the locked prefix, cannot release them.
            self._locks.release_read(locked, readers, self.l1.lock_deadline(started))
            raise
        if answer[1] is None:
            self.wake()  # queued: its locks and pins are the controller's now
        return answer

    def _begin_l2(
        self,
        handle: int,
        keys: Sequence[ObjectKey],
        readers: int,
        l1_hits: int,
        locked: list[ObjectKey],
        started: float,
        failed: dict[int, LookupResult | None],
        probed: dict[int, LookupResult],
        owner_expires: bool,
    ) -> tuple[int, list[ObjectKey] | None]:
        """``begin`` of a lookup with keys left for L2 past L1's prefix: the adapters that
        answer at once asked (those in ``probed`` about the keys after the first only), the
        request queued for the others or for loading.  A key was asked about in ``probed``
        only when it is not a repeat: it is then the first of ``unique``'s keys past L1's."""
        unique = unique_prefix(keys)
        remaining = len(unique) - l1_hits
        # The L1 prefix's hits are counted with the answer: here if it is given at once,
        # with the result if the request is queued (``_finish``).  A queued request can
        # end with no hits for its owner -- given up at its deadline, cancelled by a stop
        # -- and its lookup was then a miss, not ``l1_hits`` hits.
        self.stats.add_lookup(len(unique), 0)
        if remaining == 0:
            self.stats.add("l1_hit_chunks", l1_hits)
            return handle, locked
        logger.debug(
            "Prefetch request submitted: %d total keys, %d L1 prefix hits, %d remaining for L2",
            len(unique),
            l1_hits,
            remaining,
        )
        until = started + self._handles.result_ttl_s
        request = PrefetchRequest(
            handle, unique, readers, l1_hits, until, self.l1.lock_deadline(started), owner_expires
        )
        try:
            if self._look_up_now(request, failed, probed) and not any(request.pinned.values()):
                # every adapter answered at once, and nothing was found
                self.stats.add("l1_hit_chunks", l1_hits)
                return handle, locked
            queued = self._handles.enqueue(request)
        except BaseException:
            # Not queued, so no controller will ever give back the pins its answers took
            # (the first question's hits among them, taken over from ``probed``).
            self._locks.release_pins(request)
            raise
        if not queued:  # shutting down
            self._locks.release_pins(request)
            self.stats.add("l1_hit_chunks", l1_hits)
            return handle, locked
        return handle, None

    def _missing_everywhere_now(
        self, key: ObjectKey, failed: dict[int, LookupResult | None], probed: dict[int, LookupResult]
    ) -> bool:
        """Whether every adapter answers at once (``lookup_and_lock_now``) that it does not
        hold ``key``, the first key past L1's prefix: no prefix goes past a key no tier
        holds, so a new prompt's lookup asks about that key alone instead of every key
        (each pinned, asked and unpinned: some 2 us a key with the fs adapter), and leaves
        a lookup's keys undecoded (``LazyKeys``).  Each adapter's answer goes in ``probed``,
        a hit pinned: the lookup then asks it about the keys that follow only.

        An adapter that raised (None in ``failed``) or answered malformed (an empty
        answer in ``failed``, to be taken as a miss of every key) is not asked again at
        once: it failed this lookup's one question, counted once, as it was before."""
        for slot in self.slots:
            result = self._ask_now(slot, [key], failed)
            if result is None:
                return False
            if not self._well_formed(slot, [key], result):
                failed[slot.index] = LookupResult([], [])  # (unpinned and counted there)
                return False
            probed[slot.index] = result
            if result.found[0]:
                return False
        return True

    def _ask_now(
        self,
        slot: AdapterSlot,
        keys: list[ObjectKey],
        failed: dict[int, LookupResult | None],
        *,
        counted: bool = True,
    ) -> LookupResult | None:
        """``slot``'s ``lookup_and_lock_now`` of ``keys``: None when it cannot answer now or
        raised (counted, logged, and noted in ``failed``).  An answer is counted among the
        adapter's lookups unless ``counted`` is false (the rest of one counted already)."""
        try:
            result = slot.adapter.lookup_and_lock_now(keys)
        except Exception as exc:
            self.stats.fail("l2_lookup_now_error")
            self._adapter_failed("l2_lookup_now_error", slot, "lookup could not be answered at once", exc)
            failed[slot.index] = None
            return None
        if result is not None and counted:
            self.stats.add_adapter(slot.index, "lookups")
        return result

    def _ask_rest_now(
        self,
        slot: AdapterSlot,
        keys: list[ObjectKey],
        first: LookupResult,
        failed: dict[int, LookupResult | None],
    ) -> LookupResult | None:
        """``slot``'s answer about ``keys``, whose first it answered already (``first``, a
        hit pinned): asked about the others alone, so that no key is asked of it twice
        (each answer counted in its hits or misses).  None when it cannot answer about
        them now -- the first's pin given back, for the controller asks about every key
        -- and a miss of every key when that answer is malformed."""
        rest: LookupResult | None = LookupResult([], [])
        if len(keys) > 1:
            rest = self._ask_now(slot, keys[1:], failed, counted=False)
        if rest is not None and self._well_formed(slot, keys[1:], rest):
            return LookupResult([*first.found, *rest.found], [*first.sizes, *rest.sizes])
        if first.found[0]:
            self._locks.unpin_slot(slot, keys[:1])
        if rest is None:
            return None
        return LookupResult.misses(len(keys))  # (the rest's hits unpinned)

    def _look_up_now(
        self,
        request: PrefetchRequest,
        failed: dict[int, LookupResult | None],
        probed: dict[int, LookupResult],
    ) -> bool:
        """Ask every adapter that can answer from memory (``lookup_and_lock_now``) on this
        thread, recording their answers in ``request`` as the controller would; True
        when every adapter answered.  Those in ``failed`` are not asked: one that raised
        is left to the controller, one that answered malformed is a miss of every key.

        Only a request whose answer is a miss everywhere is settled here; one with hits
        still goes to the controller thread, which plans and loads them without asking
        those adapters again.  Those in ``probed`` answered about the first key already,
        and are asked about the others (``_ask_rest_now``).
        """
        request.remaining = request.keys[request.l1_hits :]
        answered = 0
        for slot in self.slots:
            if slot.index in failed:
                result = failed[slot.index]
                if result is not None:  # malformed, counted: nothing pinned
                    result = LookupResult.misses(len(request.remaining))
            elif slot.index in probed:
                result = self._ask_rest_now(slot, request.remaining, probed[slot.index], failed)
                del probed[slot.index]  # its pin is the request's now, or given back
            else:
                result = self._ask_now(slot, request.remaining, failed)
            if result is None:
                continue
            answered += 1
            self._record_lookup(slot, request, result)
        return answered == len(self.slots)

    def query(self, handle: int) -> int | None:
        """Prefix hit count once done (delivered once), None while running, 0 if unknown."""
        return self._handles.query(handle)

    def wait(self, handle: int, timeout: float | None) -> int | None:
        """Like ``query`` but waits up to ``timeout`` seconds; None if still running."""
        return self._handles.wait(handle, timeout)

    def discard(self, handle: int) -> None:
        """The owner will never claim ``handle``: its read locks are released now, or when
        the prefetch finishes (one still queued leaves the queue now, its pins given
        back too).  Counting why is the owner's business."""
        request = self._handles.discard(handle)
        if request is not None:
            self._drop_queued(request, publish=False)
            # Its lookup was answered "pending": dropped before it ran (its owner gave up:
            # a wait that ran out, a session that ended, a stop), it loads nothing.
            self.stats.fail("prefetch_discarded_queued")
            self._discarded_queued.event(
                1,
                "queued prefetch requests discarded by their owners before they started; "
                "their locks and pins were released",
            )

    def queued(self) -> int:
        return self._handles.queued()

    def in_flight(self) -> int:
        return self._handles.in_flight()

    def busy(self) -> bool:
        # A request given up (at its result deadline) leaves its lookups and loads running
        # until their adapters report: the L2 pins they took and the L1 extents a load fills
        # are held until then, so ``flush`` is not idle yet.
        return self._handles.busy() or bool(self._lookups.orphaned() or self._loads.orphaned())

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
            self._give_up_overdue(time.monotonic())
            self._start_queued()
        self._handles.expire(time.monotonic())

    def _give_up_overdue(self, now: float) -> None:
        """Give up requests still queued or running at their result deadline.

        Their result would be given back unclaimed as soon as it was published, while a
        lookup or load that never reports -- an adapter hung where no timeout of its own
        ends the call -- kept one of the ``max_in_flight`` slots, and every queued request
        sharing a key with it, for good.  Loads still running free the L1 extents they
        fill only when they report (see ``_abandon``).
        """
        # No result is published for them: one already past its deadline would be given
        # back (and counted as unclaimed) at once; their owners' queries answer 0.
        for request in self._handles.active():
            if request.result_deadline <= now:
                self._abandon(request, "prefetch_timed_out", publish=False)
        for request in self._handles.take_queued(overdue_at=now):
            self.stats.fail("prefetch_timed_out")
            self._timed_out.event(1, "prefetch requests given up: still queued at their result deadline")
            self._drop_queued(request, publish=False)

    def _start_queued(self) -> None:
        while self._handles.in_flight() < self.max_in_flight:
            request = self._handles.next_startable(self._claimed)
            if request is None:
                return
            try:
                self._start(request)
            except Exception:
                self._abandon(request, "prefetch_internal_error")

    def _start(self, request: PrefetchRequest) -> None:
        # Objects that became READY while the request was queued extend its L1 prefix.
        extra = self._locks.lock_l1_prefix(request.keys, request.l1_hits, request.readers)
        if extra:
            request.l1_hits += extra  # counted with the result, as the rest of the prefix
            self._locks.drop_leading_answers(request, extra)
        request.remaining = request.keys[request.l1_hits :]
        if not request.remaining:
            self._finish(request, 0)
            return
        self._claimed.update(request.remaining)
        for slot in self.slots:
            if slot.index in request.found:
                continue  # answered at once when the request was submitted
            try:
                task_id = slot.adapter.submit_lookup_and_lock(request.remaining)
            except Exception as exc:
                self.stats.fail("l2_lookup_submit_error")
                self._adapter_failed("l2_lookup_submit_error", slot, "lookup could not be submitted", exc)
                continue
            request.lookups[slot.index] = task_id
            self._lookups.track(slot, task_id, request)
            self.stats.add_adapter(slot.index, "lookups")
        if not request.lookups:
            if request.found:
                self._plan_and_load(request)
            else:
                self._finish(request, 0)

    def _reap_lookups(self, slot: AdapterSlot) -> None:
        for request, result in self._lookups.reap(slot):
            try:
                self._lookup_done(slot, request, result)
            except Exception:
                self._abandon(request, "prefetch_internal_error")

    def _lookup_done(self, slot: AdapterSlot, request: PrefetchRequest, result: LookupResult) -> None:
        self._record_lookup(slot, request, result)
        del request.lookups[slot.index]
        if not request.lookups:
            self._plan_and_load(request)

    def _record_lookup(self, slot: AdapterSlot, request: PrefetchRequest, result: LookupResult) -> None:
        """Keep one adapter's answer for ``request.remaining``, and the pins it took."""
        if not self._well_formed(slot, request.remaining, result):
            result = LookupResult.misses(len(request.remaining))
        request.found[slot.index] = result
        hits = [key for key, hit in zip(request.remaining, result.found, strict=True) if hit]
        request.pinned[slot.index] = hits
        self.stats.add_adapter(slot.index, "keys_found", len(hits))

    def _well_formed(self, slot: AdapterSlot, keys: Sequence[ObjectKey], result: LookupResult) -> bool:
        """Whether ``result`` answers for exactly ``keys`` (those asked about).  One that does not
        is an L2 miss; the hits it reports were pinned all the same (the caller unlocks
        every key reported found), and nothing else would ever unlock them: unpinned here,
        counted and logged."""
        count = len(keys)
        try:
            if len(result.found) == count and len(result.sizes) == count:
                return True
        except (AttributeError, TypeError):
            pass
        try:
            # Apart from the check: flags that are right beside sizes that are not (None,
            # missing) still name the keys the adapter pinned.
            reported = [key for key, hit in zip(keys, result.found, strict=False) if hit]
        except (AttributeError, TypeError):
            reported = []
        self.stats.fail("l2_lookup_bad_result")
        self._locks.unpin_slot(slot, reported)
        self._burst.warn(
            "l2_lookup_bad_result",
            "lookup on %s did not answer for the %d keys asked (failure reason l2_lookup_bad_result): "
            "treated as a miss",
            slot.name,
            count,
        )
        return False

    def _plan_and_load(self, request: PrefetchRequest) -> None:
        keys = request.remaining
        positions = sorted(request.found)
        # The policy reads copies: ``keys`` and the lookups' flags are the request's record
        # of what it claimed, pinned and will read-lock, so a policy writing to them (a bug,
        # or a failed attempt it then raised over) would make the controller unclaim,
        # unlock and hand off other keys than it took -- a later prefetch of the same keys
        # waiting for a claim never given back, a read lock outliving its reader.
        found = [tuple(request.found[index].found) for index in positions]
        try:
            # A third-party policy's malformed answer is its failure too (see ``load_plan``),
            # and so is a ``retain_loaded`` it cannot answer.
            with plugin_code():
                answer = self.policy.select_load_plan(
                    tuple(keys), found, [self.slots[i].info() for i in positions]
                )
                plan = load_plan(answer, len(keys))
                temporary = not self.policy.retain_loaded
        except Exception:
            self.stats.fail("prefetch_policy_error")
            self._policy_log.failed(
                "prefetch policy failed; treating request %d as an L2 miss", request.handle
            )
            plan, temporary = {}, True
        self._drop_unasked(request, plan)
        sources = contiguous_sources(keys, plan, request.found)
        self._count_planned_misses(request, plan, len(sources))
        self._locks.reserve_planned(request, sources, temporary=temporary)
        # Phase 1: drop pins of everything that will not be loaded from that adapter, nor
        # loaded from it should its source fail to load it.
        to_load = request.loads_by_adapter()
        request.spares = request.spare_sources()
        for index in list(request.pinned):
            keep = set(to_load.get(index, ()))
            keep.update(key for key, spares in request.spares.items() if index in spares)
            self._locks.unpin(request, index, [key for key in request.pinned[index] if key not in keep])
        for index, load_keys in to_load.items():
            if not self._submit_load(request, self.slots[index], load_keys):
                self._load_elsewhere(request, load_keys)
        if not request.loads:
            self._hand_off(request)

    def _drop_unasked(self, request: PrefetchRequest, plan: dict[int, list[bool]]) -> None:
        """Remove from ``plan`` the adapters this request did not ask (an index no adapter
        has, or one whose lookup did not answer): nothing can be loaded from them, and the
        keys planned there end the prefix -- counted and logged, not passed over unseen."""
        for index in [index for index in plan if index not in request.found]:
            planned = sum(plan.pop(index))
            if not planned:
                continue
            self.stats.fail("prefetch_policy_bad_adapter", planned)
            self._burst.warn(
                "prefetch_policy_bad_adapter",
                "prefetch policy planned %d keys of request %d from adapter %r, which %s: not loaded",
                planned,
                request.handle,
                index,
                "this request did not ask"
                if 0 <= index < len(self.slots)
                else f"does not exist ({len(self.slots)} adapters)",
            )

    def _count_planned_misses(self, request: PrefetchRequest, plan: dict[int, list[bool]], cut: int) -> None:
        """Count keys ``plan`` loads only from adapters whose lookup did not find them.
        Nothing can be loaded for them, so they end the prefix as keys planned nowhere do
        (a miss is safe); but the policy meant them loaded -- a bad plan, counted and
        logged like one naming an adapter not asked, not a prefix cut short unseen.

        ``cut`` is where the planned prefix ends: every key before it has a source, so
        there is nothing to count unless the key at the cut was planned somewhere -- one
        check per request on the usual path (a shipped policy plans found keys only)."""
        found = request.found
        planned = [(flags, found[index].found) for index, flags in plan.items() if index in found]

        def planned_here(position: int) -> bool:
            return any(position < len(flags) and flags[position] for flags, _ in planned)

        def found_where_planned(position: int) -> bool:
            return any(position < len(flags) and flags[position] and hit[position] for flags, hit in planned)

        if cut >= len(request.remaining) or not planned_here(cut):
            return
        missed = sum(
            1
            for position in range(cut, len(request.remaining))
            if planned_here(position) and not found_where_planned(position)
        )
        self.stats.fail("prefetch_policy_planned_miss", missed)
        self._burst.warn(
            "prefetch_policy_planned_miss",
            "prefetch policy planned %d keys of request %d only from adapters whose lookup did not find "
            "them (failure reason prefetch_policy_planned_miss): not loaded, the prefix ends at the first",
            missed,
            request.handle,
            count=missed,
        )

    def _submit_load(self, request: PrefetchRequest, slot: AdapterSlot, keys: list[ObjectKey]) -> bool:
        """Submit a load of ``keys`` into their reserved L1 objects; False if it could not
        be (counted, logged, and the keys' pins on ``slot`` dropped).  Keys whose
        reservation left L1 since the plan are left out (``_lend_fills``): True, with no
        load, when none is left."""
        try:
            keys, objects, loans = self._lend_fills(request, slot, keys)
            if not keys:
                return True
            task_id = slot.adapter.submit_load(keys, [loan.buffer for loan in loans])
        except Exception as exc:
            self.stats.fail("l2_load_submit_error")
            self._adapter_failed(
                "l2_load_submit_error", slot, f"load of {len(keys)} keys could not be submitted", exc
            )
            self._locks.unpin(request, slot.index, keys)
            return False
        request.loads.add((slot.index, task_id))
        self._loads.track(slot, task_id, PrefetchLoad(request, (slot.index, task_id), keys, objects, loans))
        self.stats.add_adapter(slot.index, "load_tasks_submitted")
        return True

    def _lend_fills(
        self, request: PrefetchRequest, slot: AdapterSlot, keys: list[ObjectKey]
    ) -> tuple[list[ObjectKey], list[L1Object], list[L1Loan]]:
        """The keys of ``keys`` whose reserved L1 objects are still theirs, those objects, and
        loans of them to fill from ``slot``.  A reservation can leave L1 between the plan and
        the load -- a client's write of its key takes it over (counted
        ``l1_load_taken_over_by_write``, ``l1/writes.py``), its write TTL passes -- on
        another thread at any moment: lent with the others, it would fail their whole
        submit, blamed on the adapter, and every key of it would be a miss.  Left out
        instead, its pins here and on its spare adapters dropped: a miss where the prefix
        reaches it, and its held extent goes back when the request ends (``abort_load``)."""
        kept: list[ObjectKey] = []
        objects: list[L1Object] = []
        loans: list[L1Loan] = []
        gone: list[ObjectKey] = []
        for key in keys:
            obj = request.reserved[key]
            try:
                loan = self.l1.lend(obj, fill=True)
            except KeyError:
                gone.append(key)
                continue
            kept.append(key)
            objects.append(obj)
            loans.append(loan)
        if gone:
            self._locks.unpin(request, slot.index, gone)
            self._drop_spares(request, gone)
        return kept, objects, loans

    def _load_elsewhere(self, request: PrefetchRequest, keys: list[ObjectKey]) -> None:
        """Load ``keys``, which their adapter failed to load (or to take a load of), from
        the next of their spare adapters; those that have none left stay failed, a miss.

        Each key's L1 object is the one reserved for it, filled by one load at a time: the
        load that failed has reported, so its adapter is done with the buffer, and the next
        fills it whole (a spare found the key at the reserved size) or fails in its turn.
        Its bytes become readable only through a load that reports them loaded, as any
        load's do.  Each spare is tried once, so this ends within the adapters' count, and
        within the request's result deadline, at which a load still running is given up.
        """
        pending = keys
        while pending:
            by_adapter: dict[int, list[ObjectKey]] = {}
            given_up: list[ObjectKey] = []
            for key in pending:
                spares = request.spares.get(key)
                if spares and self.l1.get(key) is request.reserved[key]:
                    by_adapter.setdefault(spares.pop(0), []).append(key)
                else:
                    given_up.append(key)
            # A reservation no longer in L1 (a client's write of the key took it, counted
            # l1_load_taken_over_by_write; a clear) is no load's to fill: tried with the
            # others, it would fail their whole submit, blamed on the adapter.
            self._drop_spares(request, given_up)
            pending = []
            for index, group in by_adapter.items():
                slot = self.slots[index]
                self.stats.fail("l2_load_fallback", len(group))
                self._fallbacks.warn(
                    slot.name,
                    "%d keys another adapter failed to load are loaded from %s instead (failure "
                    "reason l2_load_fallback)",
                    len(group),
                    slot.name,
                    count=len(group),
                )
                self._set_sources(request, group, index)
                if not self._submit_load(request, slot, group):
                    pending.extend(group)

    def _set_sources(self, request: PrefetchRequest, keys: list[ObjectKey], index: int) -> None:
        positions = {key: position for position, key in enumerate(request.remaining[: len(request.sources)])}
        for key in keys:
            request.sources[positions[key]] = index

    def _drop_spares(self, request: PrefetchRequest, keys: Iterable[ObjectKey]) -> None:
        """``keys`` need no other adapter any more: their pins there go."""
        by_adapter: dict[int, list[ObjectKey]] = {}
        for key in keys:
            for index in request.spares.pop(key, ()):
                by_adapter.setdefault(index, []).append(key)
        for index, spare_keys in by_adapter.items():
            self._locks.unpin(request, index, spare_keys)

    def _adapter_failed(self, reason: str, slot: AdapterSlot, what: str, exc: Exception) -> None:
        """Log an adapter call that raised (counted under ``reason`` by the caller): one
        line per burst per adapter -- an adapter that raises does so for every request --
        and the exception as its text, whose traceback would hold the request's L1 views."""
        self._burst.warn(
            f"{reason}:{slot.index}",
            "%s: %s (failure reason %s): %s: %s",
            slot.name,
            what,
            reason,
            type(exc).__name__,
            exc,
        )

    def _reap_loads(self, slot: AdapterSlot) -> None:
        for load, results in self._loads.reap(slot):
            if load.task not in load.request.loads:
                # Its request was given up while an earlier result of this batch was handled:
                # the give-up found the load reported, unpinned its keys and freed its
                # objects.  Handled now, it would unpin them again -- pins other holders
                # took since -- and end the request a second time.
                continue
            try:
                self._load_done(slot, load, results)
            except Exception:
                self._abandon(load.request, "prefetch_internal_error")

    def _load_done(self, slot: AdapterSlot, load: PrefetchLoad, reported: list[bool]) -> None:
        # Phase 2: the bytes are in L1 (or never will be).
        request, keys = load.request, load.keys
        # As their records give them: L1 objects filled from L2 keep the layout their
        # writer declared, so a front end's layout check still applies to them.
        # This load's own, carried by its result: another load of a key may have read a
        # record of another layout (an engine of another dtype sharing the keys).
        layouts = dict(zip(keys, layouts_of(reported), strict=False))
        loaded = [key for key, ok in zip(keys, load.commit(reported), strict=False) if ok]
        request.loaded.update(loaded)
        request.layouts.update((key, layouts[key]) for key in loaded if layouts.get(key))
        self._locks.unpin(request, slot.index, keys)  # the pins have done their job
        self.stats.add_adapter(slot.index, "keys_loaded", len(loaded))
        if len(loaded) < len(keys):
            self._count_failed_loads(slot, len(keys) - len(loaded))
        request.loads.discard(load.task)
        if request.spares:
            # A key the adapter did not report loaded may be another's to load; one it
            # reported loaded is settled, even if the copy into L1 failed (L1's failure,
            # which another adapter's bytes would meet too).
            flags = list(reported)
            failed = [
                key for position, key in enumerate(keys) if position >= len(flags) or not flags[position]
            ]
            self._drop_spares(request, set(keys).difference(failed))
            self._load_elsewhere(request, failed)
        if not request.loads:
            self._hand_off(request)

    def _count_failed_loads(self, slot: AdapterSlot, failed: int) -> None:
        # The adapter may log its own cause (a backend error, a corrupt record), or report
        # the keys failed without a word: this line ties them to the prefetch's miss.
        self.stats.add_adapter(slot.index, "keys_load_failed", failed)
        self.stats.fail("l2_load_failed", failed)
        self._failed_loads.warn(
            slot.name,  # per adapter: one failing must not hide another's failures for a window
            "%s: %d keys its lookup found failed to load (failure reason l2_load_failed): each is a "
            "miss, ending the prefix, unless another adapter that found it loads it "
            "(l2_load_fallback); the adapter's stats (adapter_stat, e.g. load_keys_failed, "
            "serde_decode_failures, corrupt_records_removed) and its log lines say why",
            slot.name,
            failed,
            count=failed,
        )

    def _hand_off(self, request: PrefetchRequest) -> None:
        # Every key's spares were dropped when it loaded or ran out of them: none is left
        # pinned here, but a pin kept past its request would hold the key in L2 for good.
        request.spares.clear()
        self._locks.release_pins(request)
        cut = self._locks.hand_off(request, request.not_before)
        l2_hits = sum(1 for source in request.sources[:cut] if source is not None)
        self._finish(request, cut, l2_hits)

    def _finish(self, request: PrefetchRequest, l2_prefix: int, l2_hits: int = 0) -> None:
        """Publish the result and forget the request (all its locks are settled).  Its hits
        are counted here, as the result gives them: ``l2_hits`` of the ``l2_prefix`` keys
        past the L1 prefix were loaded, the others were in L1 (as was the prefix).  A
        request that ends with no result counts none (its owner is answered 0)."""
        self._unclaim(request)
        hits = request.l1_hits + l2_prefix
        if l2_hits:
            self.stats.add("l2_hit_chunks", l2_hits)
        if hits > l2_hits:
            self.stats.add("l1_hit_chunks", hits - l2_hits)
        held_until = request.held_until
        result = HeldResult(hits, request.keys[:hits], request.readers, held_until, request.not_before)
        self._handles.finish(request.handle, result)

    def _unclaim(self, request: PrefetchRequest) -> None:
        """The request loads none of its keys any more."""
        if request.remaining:
            self._claimed.subtract(request.remaining)
            for key in request.remaining:
                if self._claimed[key] <= 0:
                    del self._claimed[key]

    def _abandon(self, request: PrefetchRequest, reason: str, *, publish: bool = True) -> None:
        """Give up on a request (shutdown, or an unexpected error) and release what it holds.

        Objects a running load is still filling are freed only when that load reports:
        freeing them now could hand their extents to new objects while the adapter still
        writes into them.  Lookups still running have their pins dropped when they report.
        """
        self.stats.fail(reason)
        if reason == "prefetch_timed_out":  # many at once when an adapter hangs: one line a minute
            self._timed_out.event(1, "prefetch requests given up: still loading at their result deadline")
        else:
            logger.log(
                logging.ERROR if reason == "prefetch_internal_error" else logging.WARNING,
                "prefetch request %d abandoned (%s)",
                request.handle,
                reason,
                exc_info=reason == "prefetch_internal_error",
            )
        for index, task_id in request.lookups.items():
            self._lookups.orphan(index, task_id, self._settle_orphan_lookup)
        loading: dict[int, set[ObjectKey]] = {}
        for index, task_id in request.loads:
            load = self._loads.orphan(index, task_id, self._settle_orphan_load)
            if load is not None:
                loading.setdefault(index, set()).update(load.keys)
        request.lookups.clear()
        request.loads.clear()
        self._locks.release_all(request, loading, request.not_before)
        if publish:
            self._finish(request, 0)
        else:
            self._unclaim(request)
            self._handles.give_up(request.handle)

    def _settle_orphan_lookup(
        self, slot: AdapterSlot, request: PrefetchRequest, result: LookupResult
    ) -> None:
        # The abandoned request will not load them: drop the pins the lookup took.
        if self._well_formed(slot, request.remaining, result):
            hits = [key for key, hit in zip(request.remaining, result.found, strict=True) if hit]
            self._locks.unpin_slot(slot, hits)

    def _settle_orphan_load(self, slot: AdapterSlot, load: PrefetchLoad, results: list[bool]) -> None:
        # The adapter is done with the buffers: the objects can be freed, the pins dropped.
        self._locks.unpin_slot(slot, load.keys)
        self.l1.abort_load(load.objects)

    # -- shutdown ------------------------------------------------------------------------

    def _cancel_queued(self) -> None:
        """Answer the requests still queued at the stop with 0 hits.  Each is a lookup
        the stop turned into a miss, counted as the running ones given up are."""
        cancelled = self._handles.take_queued()
        for request in cancelled:
            self._drop_queued(request)
        if cancelled:
            self.stats.fail("prefetch_abandoned", len(cancelled))
            logger.warning(
                "%d queued prefetch requests abandoned at the stop (prefetch_abandoned)", len(cancelled)
            )

    def _drop_queued(self, request: PrefetchRequest, *, publish: bool = True) -> None:
        """Release what a request that never started holds; its result is 0 hits (or none:
        its owner's query answers 0 all the same)."""
        self._locks.release_read(request.keys[: request.l1_hits], request.readers, request.not_before)
        self._locks.release_pins(request)
        if publish:
            self._handles.publish(request.handle, HeldResult(0, [], request.readers, request.held_until))
        else:
            self._handles.give_up(request.handle)

    def finish(self) -> None:
        """Release what requests that did not drain in time still hold."""
        self._handles.close()
        self._cancel_queued()
        for request in self._handles.active():
            self._abandon(request, "prefetch_abandoned")
