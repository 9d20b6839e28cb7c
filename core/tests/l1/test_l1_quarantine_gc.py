"""Extents held for an expired lock's grace period allocate nothing the collector tracks.

A burst of write reservations past the write TTL is quarantined one extent per
reservation.  A record object per extent made 100k of them pile up survivors of the
young generations, and the full collections those brought paused the whole server
(~80 ms) in the middle of the reap.  Counting the objects the garbage collector tracks
before and after the reap tells it without timing anything.  The extents must still be
held: the grace period is what keeps them from a writer that may still be copying.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l1.removal import REAP_BATCH

ALIGN = 512
TTL_S = 30.0
GRACE_S = 10.0
MASS = 4 * REAP_BATCH


@pytest.fixture
def collector_off() -> Iterator[None]:
    """No automatic collection in between: the counts compare what the reap left alive."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def tracked_objects() -> int:
    gc.collect()  # frees the garbage and stops tracking the tuples of numbers
    return len(gc.get_objects())


def test_a_mass_of_expired_reservations_is_held_without_a_tracked_object_each(collector_off) -> None:
    with L1Manager(
        MASS * ALIGN, align=ALIGN, prefault=False, lock_ttl_s=TTL_S, write_ttl_s=TTL_S, lease_grace_s=GRACE_S
    ) as l1:
        keys = [ObjectKey("quarantine-gc", 0, index.to_bytes(8, "big")) for index in range(MASS)]
        reserved = l1.reserve_write(keys, [ALIGN] * MASS)
        deadline = max(obj.lock_deadline for obj in reserved.values())
        before = tracked_objects()
        reaped = l1.expire_locks(deadline)
        while l1.reap_backlog:
            reaped += l1.expire_locks(deadline)
        added = tracked_objects() - before
        assert reaped == MASS
        stats = l1.lease_stats()
        assert (stats.quarantined_extents, stats.quarantined_bytes) == (MASS, MASS * ALIGN)
        assert l1.used_bytes == MASS * ALIGN, "an extent in its grace period went back"
        assert added < MASS // 10, f"{added} objects tracked for {MASS} extents held"
        # Held, not lost: the grace period ends and every extent goes back, once.
        while l1.expire_locks(deadline + GRACE_S) or l1.reap_backlog:
            pass
        stats = l1.lease_stats()
        assert (stats.quarantined_extents, stats.quarantined_bytes) == (0, 0)
        assert (stats.reclaimed_lease_end, stats.reclaimed_bytes) == (MASS, MASS * ALIGN)
        assert l1.used_bytes == 0
        for obj in reserved.values():
            assert not l1._leases.holds(obj)
