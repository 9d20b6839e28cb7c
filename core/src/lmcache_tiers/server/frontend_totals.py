"""The front ends' counters summed so that the sum never falls while one cannot be read.

A front end is a plugin: its ``stats()`` may raise for one read and answer again for the
next.  Left out of a sum, its counters would make ``/status``'s totals and ``/metrics``'
summed counters fall for that read (a reset to Prometheus, and on its return its whole
count again in ``rate()``).  Its last readable counters stand in for it instead; its
gauges (work in flight, clients) do not, since they may fall and holding them would show
work long done.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import NamedTuple

from lmcache_tiers.frontend import FrontendStats, merged_stats

#: each front end's name and counters (the readable ones only)
FrontendStatsProvider = Callable[[], list[tuple[str, FrontendStats]]]

#: the gauges among a front end's stats: never held for a read that cannot reach them
FRONTEND_GAUGES = ("pending_prefetches", "reserved_stores", "locked_keys", "pool_tasks", "sessions")


class FrontendTotals(NamedTuple):
    #: the front ends read now, each with its own stats
    readable: list[tuple[str, FrontendStats]]
    #: their sum, with the last readable counters of those that could not be read now
    total: FrontendStats
    #: names of the front ends read before that could not be read now (their counters held)
    held: list[str]


class HeldFrontendTotals:
    """Reads the front ends through ``provider`` and keeps, per front end, the counters of
    its last readable ``stats()``.  Shared by ``/status`` and ``/metrics`` so both hold
    the same values; safe to call from several HTTP threads at once."""

    def __init__(self, provider: FrontendStatsProvider) -> None:
        self._provider = provider
        # the lock also orders concurrent reads with their copies: the copy kept is the newest
        self._lock = threading.Lock()
        self._last_read: dict[str, FrontendStats] = {}

    def read(self) -> FrontendTotals:
        with self._lock:
            readable = self._provider()
            for name, part in readable:
                kept = merged_stats([part])  # a copy: the front end goes on counting
                for gauge in FRONTEND_GAUGES:
                    setattr(kept, gauge, 0)
                self._last_read[name] = kept
            read = {name for name, _ in readable}
            held = {name: part for name, part in self._last_read.items() if name not in read}
        total = merged_stats([*(part for _, part in readable), *held.values()])
        return FrontendTotals(readable, total, sorted(held))
