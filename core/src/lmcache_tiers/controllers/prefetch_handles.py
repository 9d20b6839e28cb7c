"""Every prefetch by handle, from submission until its owner collects the result.

A handle is *queued* (waiting for a slot), *active* (running on the controller thread) or
*done* (its result held in :class:`PrefetchResults` with the read locks it took).  Front
ends ask about handles from their own threads while the controller thread moves requests
along, so one lock guards the three and a condition wakes waiters when a result lands.
A handle that is none of them was collected (or never existed) and answers 0.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter, deque
from collections.abc import Callable

from lmcache_tiers.controllers.prefetch_requests import PrefetchRequest
from lmcache_tiers.controllers.prefetch_results import HeldResult, PrefetchResults
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey

#: results waiting for their owners beyond this many are given back, oldest first
MAX_UNCLAIMED_RESULTS = 1 << 16


class PrefetchHandles:
    """Queued, active and finished prefetches; thread-safe."""

    def __init__(
        self,
        release: Callable[[list[ObjectKey], int, float | None], None],
        stats: EngineStats,
        *,
        result_ttl_s: float,
    ) -> None:
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._queue: deque[PrefetchRequest] = deque()
        self._queued: set[int] = set()
        # changed under the lock (queries look at it) by the controller thread only
        self._active: dict[int, PrefetchRequest] = {}
        self._results = PrefetchResults(release, stats, ttl_s=result_ttl_s, limit=MAX_UNCLAIMED_RESULTS)
        self._closed = False  # set once the controller is done: submits complete at once

    @property
    def result_ttl_s(self) -> float:
        return self._results.ttl_s

    def new_handle(self) -> int:
        return next(self._numbers)

    # -- front ends ----------------------------------------------------------------------

    def enqueue(self, request: PrefetchRequest) -> bool:
        """Queue ``request``; False once the controller is done (nothing may be queued)."""
        with self._lock:
            if self._closed:
                return False
            self._queue.append(request)
            self._queued.add(request.handle)
            return True

    def query(self, handle: int) -> int | None:
        with self._lock:
            return self._claim(handle)

    def wait(self, handle: int, timeout: float | None) -> int | None:
        with self._lock:
            self._done.wait_for(lambda: self._claim_ready(handle), timeout)
            return self._claim(handle)

    def discard(self, handle: int) -> PrefetchRequest | None:
        """The owner will never claim ``handle``.  A request still queued leaves the queue
        and is returned: what it holds (its L1 prefix's read locks, its adapters' pins) is
        the caller's to give back now -- waiting for a slot, it would hold them for nobody
        up to its result deadline, then load its keys for nobody.  A running one gives its
        result back once it finishes."""
        with self._lock:
            if handle in self._queued:
                request = next(queued for queued in self._queue if queued.handle == handle)
                self._queue.remove(request)
                self._queued.discard(handle)
                return request
            self._results.discard(handle, running=handle in self._active)
            return None

    def queued(self) -> int:
        with self._lock:
            return len(self._queue)

    def in_flight(self) -> int:
        return len(self._active)

    def busy(self) -> bool:
        return bool(self._active) or self.queued() > 0

    def _claim_ready(self, handle: int) -> bool:
        return handle in self._results or (handle not in self._queued and handle not in self._active)

    def _claim(self, handle: int) -> int | None:
        hits = self._results.claim(handle)
        if hits is not None:
            return hits
        if handle in self._queued or handle in self._active:
            return None
        return 0

    # -- the controller thread -----------------------------------------------------------

    def publish(self, handle: int, result: HeldResult) -> None:
        with self._lock:
            self._publish(handle, result)

    def next_startable(self, claimed: Counter[ObjectKey]) -> PrefetchRequest | None:
        """The oldest queued request that loads none of the ``claimed`` keys, now active."""
        # A request overlapping keys another active request is loading waits for it:
        # started now it would find them write-locked and miss, started later it finds
        # them READY in L1.
        with self._lock:
            for position, request in enumerate(self._queue):
                if not any(key in claimed for key in request.keys[request.l1_hits :]):
                    del self._queue[position]
                    self._queued.discard(request.handle)
                    self._active[request.handle] = request
                    return request
        return None

    def finish(self, handle: int, result: HeldResult) -> None:
        """An active request is done: ``result`` is its owner's to collect."""
        with self._lock:
            # Leaving _active and publishing under one lock: a query in between must not
            # mistake the handle for an unknown one.
            self._active.pop(handle, None)
            self._publish(handle, result)

    def give_up(self, handle: int) -> None:
        """An active or queued (already taken) request ends without a result: its owner's
        query or wait answers 0 at once, as for a result given back."""
        with self._lock:
            self._active.pop(handle, None)
            self._results.forget(handle)
            self._done.notify_all()

    def take_queued(self, overdue_at: float | None = None) -> list[PrefetchRequest]:
        """Every queued request (or those whose result deadline is ``overdue_at`` or
        earlier), no longer queued: their results are the caller's to publish."""
        taken: list[PrefetchRequest] = []
        with self._lock:
            # Queued in order of submission, so in order of deadline: the overdue ones lead.
            while self._queue and (overdue_at is None or self._queue[0].result_deadline <= overdue_at):
                request = self._queue.popleft()
                self._queued.discard(request.handle)
                taken.append(request)
        return taken

    def active(self) -> list[PrefetchRequest]:
        return list(self._active.values())

    def close(self) -> None:
        """From now on nothing is queued: submits are answered at once."""
        with self._lock:
            self._closed = True

    def expire(self, now: float) -> None:
        with self._lock:
            self._results.expire(now)

    def _publish(self, handle: int, result: HeldResult) -> None:
        self._results.publish(handle, result)
        self._done.notify_all()
