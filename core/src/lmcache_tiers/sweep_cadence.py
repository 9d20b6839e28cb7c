"""How often a sweep that reaps or forgets what outlived its TTL runs.

L1's reaping of expired locks (the L1 eviction thread) and a front end's sweep of its
clients' sessions each let what a TTL ended hold memory, or count, until they run: a
fixed period is either too slow for a short TTL (an expired lock holding L1 space for
several of its TTLs) or wakes needlessly often for a long one.  So each runs at a
fraction of the shortest TTL it enforces, within bounds: what expires is reaped at most
that fraction of its TTL late -- unless the sweep itself is slow (L1's reap costs what
expired, under the lock every write and read needs: a hundred thousand locks ending at once
take a good part of a second; a front end's sweep walks its sessions): then its own cost
spaces it out (:func:`next_sweep_at`).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["SWEEP_COST_FACTOR", "SWEEP_FLOOR_S", "SWEEP_TTL_FRACTION", "next_sweep_at", "sweep_interval"]

#: the shortest period: below it the sweep's own cost (under the L1 lock for L1's reap)
#: would be paid more often than any TTL worth having needs
SWEEP_FLOOR_S = 0.05
#: the sweep runs every this fraction of the shortest TTL (an expired lock is reaped at
#: most a quarter of its TTL late)
SWEEP_TTL_FRACTION = 0.25
#: after a sweep, at least this many times its duration passes before the next: a sweep
#: runs (and holds what it locks) at most 1 / (1 + this) of the time, 5 %, whatever it walks
SWEEP_COST_FACTOR = 19.0


def sweep_interval(ttls: Iterable[float], ceiling: float) -> float:
    """The period of a sweep enforcing ``ttls``: :data:`SWEEP_TTL_FRACTION` of the shortest
    positive one, at least :data:`SWEEP_FLOOR_S` and at most ``ceiling`` (which it is when
    no TTL is positive; a ceiling under the floor wins)."""
    shortest = min((ttl for ttl in ttls if ttl > 0), default=None)
    if shortest is None:
        return ceiling
    return min(ceiling, max(SWEEP_FLOOR_S, shortest * SWEEP_TTL_FRACTION))


def next_sweep_at(started: float, ended: float, interval: float) -> float:
    """When the sweep that ran from ``started`` to ``ended`` (``time.monotonic()`` values) is
    next due: ``interval`` after it started, or, if it took more than a twentieth of that,
    :data:`SWEEP_COST_FACTOR` times its duration after it ended -- so that a slow sweep
    under a short interval does not run back to back."""
    return max(started + interval, ended + SWEEP_COST_FACTOR * (ended - started))
