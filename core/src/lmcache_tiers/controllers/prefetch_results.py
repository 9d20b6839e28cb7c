"""Finished prefetches waiting for their owner, with the L1 read locks they hold for it.

A prefetch read-locks the prefix it found on its owner's behalf, and the owner learns the
hit count -- which keys it now holds -- only by claiming the result.  So a result keeps its
locks until it is claimed, but not forever: one nobody claims within the result TTL of its
submission, one pushed out because too many results wait, or one whose owner said it will
never claim it is *given back*: its locks are released and the reason is counted.

The TTL is shorter than the L1 lock TTL, so the locks given back are still the result's
own: L1 cannot have reaped them and handed the objects to another reader yet.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey

logger = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class HeldResult:
    hits: int
    locked: list[ObjectKey]  # read-locked ``readers`` times for the owner
    readers: int
    #: monotonic time after which nobody will claim it; inf: its owner gives it back
    #: itself (``PrefetchRequest.owner_expires``)
    deadline: float
    #: a lower bound on the deadlines of its locks (``L1Manager.lock_deadline`` of a time
    #: read before they were taken), so that giving them back drops them and never a lock
    #: another holder forgot; None: unknown
    not_before: float | None = None


class PrefetchResults:
    """Results by handle; not thread-safe (the prefetch controller's lock guards it)."""

    def __init__(
        self,
        release: Callable[[list[ObjectKey], int, float | None], None],
        stats: EngineStats,
        *,
        ttl_s: float,
        limit: int,
    ) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._release = release
        self._stats = stats
        self._held: OrderedDict[int, HeldResult] = OrderedDict()
        self._discarded: set[int] = set()  # owners gave up while these were running
        self._next_deadline = math.inf
        self._burst_logs = {
            reason: BurstLog(logger, reason)
            for reason in ("prefetch_result_dropped", "prefetch_result_expired")
        }

    def __contains__(self, handle: int) -> bool:
        return handle in self._held

    def __len__(self) -> int:
        return len(self._held)

    def publish(self, handle: int, result: HeldResult) -> None:
        if handle in self._discarded:
            self._discarded.discard(handle)
            self._give_back([result])  # counted by the owner that discarded it
            return
        self._held[handle] = result
        self._next_deadline = min(self._next_deadline, result.deadline)
        if len(self._held) > self.limit:
            dropped: list[HeldResult] = []
            while len(self._held) > self.limit:
                dropped.append(self._held.popitem(last=False)[1])
            self._count("prefetch_result_dropped", dropped, f"more than {self.limit} results waited")

    def claim(self, handle: int) -> int | None:
        """The hit count, once: the owner holds the result's locks from now on."""
        held = self._held.pop(handle, None)
        return None if held is None else held.hits

    def forget(self, handle: int) -> None:
        """A running prefetch ended without a result (given up): nothing will be
        published for ``handle``, so an owner's earlier discard is done with."""
        self._discarded.discard(handle)

    def discard(self, handle: int, *, running: bool) -> None:
        """The owner will never claim ``handle``: give its locks back now, or as soon as
        the prefetch finishes if it is still ``running``."""
        held = self._held.pop(handle, None)
        if held is not None:
            self._give_back([held])
        elif running:
            self._discarded.add(handle)

    def expire(self, now: float) -> None:
        if now < self._next_deadline:
            return
        expired = [handle for handle, held in self._held.items() if held.deadline <= now]
        self._count(
            "prefetch_result_expired",
            [self._held.pop(handle) for handle in expired],
            f"not claimed within {self.ttl_s:g}s",
        )
        self._next_deadline = min((held.deadline for held in self._held.values()), default=math.inf)

    def _count(self, reason: str, results: list[HeldResult], why: str) -> None:
        if not results:
            return
        self._stats.fail(reason, len(results))
        keys = self._give_back(results)
        self._burst_logs[reason].event(
            len(results), f"prefetch results {why}; their read locks on {keys} keys were released"
        )

    def _give_back(self, results: list[HeldResult]) -> int:
        keys = 0
        for held in results:
            if held.locked:
                self._release(held.locked, held.readers, held.not_before)
                keys += len(held.locked)
        return keys
