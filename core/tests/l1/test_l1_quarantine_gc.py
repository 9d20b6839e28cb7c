"""Extents of expired write reservations are held without a tracked object each.

A burst of write reservations past the write TTL is quarantined one extent per
reservation: for the grace period, or fenced until their writers say they stopped
copying (writers into the shared arena).  A record object per extent made 100k of them
pile up survivors of the young generations, and the full collections those brought
paused the whole server (40-130 ms) in the middle of the reap.  Counting the objects the
garbage collector tracks before and after the reap tells it without timing anything.
The extents must still be held: the grace period and the fence are what keep them from
a writer that may still be copying.
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


@pytest.mark.parametrize("fenced", [False, True], ids=["grace", "fenced"])
def test_a_mass_of_expired_reservations_is_held_without_a_tracked_object_each(
    collector_off, fenced: bool
) -> None:
    with L1Manager(
        MASS * ALIGN, align=ALIGN, prefault=False, lock_ttl_s=TTL_S, write_ttl_s=TTL_S, lease_grace_s=GRACE_S
    ) as l1:
        keys = [ObjectKey("quarantine-gc", 0, index.to_bytes(8, "big")) for index in range(MASS)]
        reserved = l1.reserve_write(keys, [ALIGN] * MASS)
        deadline = max(obj.lock_deadline for obj in reserved.values())
        if fenced:
            assert l1.fence_writers(list(reserved.values())) == []
        before = tracked_objects()
        reaped = l1.expire_locks(deadline)
        while l1.reap_backlog:
            reaped += l1.expire_locks(deadline)
        added = tracked_objects() - before
        assert reaped == MASS
        stats = l1.lease_stats()
        assert (stats.quarantined_extents, stats.quarantined_bytes) == (MASS, MASS * ALIGN)
        assert (stats.fenced_extents, stats.fenced_bytes) == ((MASS, MASS * ALIGN) if fenced else (0, 0))
        assert added < MASS // 10, f"{added} objects tracked for {MASS} extents held"
        # Held, not lost: the grace period ends, or the writers say they are done, and
        # every extent goes back, once.
        while l1.expire_locks(deadline + GRACE_S) or l1.reap_backlog:
            pass
        if fenced:
            assert l1.used_bytes == MASS * ALIGN, "a fenced extent went back at a lease end"
            assert l1.writers_done(list(reserved.values())) == MASS
            assert l1.writers_done(list(reserved.values())) == 0
        stats = l1.lease_stats()
        assert (stats.quarantined_extents, stats.quarantined_bytes, stats.fenced_extents) == (0, 0, 0)
        ended = stats.reclaimed_writer_done if fenced else stats.reclaimed_lease_end
        assert (ended, stats.reclaimed_bytes) == (MASS, MASS * ALIGN)
        assert l1.used_bytes == 0
        for obj in reserved.values():
            assert not l1._leases.holds(obj)
