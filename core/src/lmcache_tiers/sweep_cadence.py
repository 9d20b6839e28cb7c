"""How often a sweep that reaps or forgets what outlived its TTL runs.

L1's reaping of expired locks (the L1 eviction thread) and a front end's sweep of its
clients' sessions each let what a TTL ended hold memory, or count, until they run: a
fixed period is either too slow for a short TTL (an expired lock holding L1 space for
several of its TTLs) or wakes needlessly often for a long one.  So each runs at a
fraction of the shortest TTL it enforces, within bounds: what expires is reaped at most
that fraction of its TTL late.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["SWEEP_FLOOR_S", "SWEEP_TTL_FRACTION", "sweep_interval"]

#: the shortest period: below it the sweep's own cost (it walks what is locked, under the
#: L1 lock) would be paid more often than any TTL worth having needs
SWEEP_FLOOR_S = 0.05
#: the sweep runs every this fraction of the shortest TTL (an expired lock is reaped at
#: most a quarter of its TTL late)
SWEEP_TTL_FRACTION = 0.25


def sweep_interval(ttls: Iterable[float], ceiling: float) -> float:
    """The period of a sweep enforcing ``ttls``: :data:`SWEEP_TTL_FRACTION` of the shortest
    positive one, at least :data:`SWEEP_FLOOR_S` and at most ``ceiling`` (which it is when
    no TTL is positive; a ceiling under the floor wins)."""
    shortest = min((ttl for ttl in ttls if ttl > 0), default=None)
    if shortest is None:
        return ceiling
    return min(ceiling, max(SWEEP_FLOOR_S, shortest * SWEEP_TTL_FRACTION))
