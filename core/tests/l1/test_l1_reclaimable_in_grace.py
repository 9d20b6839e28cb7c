"""An unlocked object whose read locks expired within the grace period is not reclaimable
yet: evicting it holds its extent back until the period ends, so ``reclaimable_bytes``,
``unevictable_extents`` and ``reclaimable_spans`` count it as no eviction frees -- and a
write that no eviction can fit now is refused before evicting, not after emptying L1."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, leases

ALIGN = 4096
BLOCKS = 8
CAPACITY = BLOCKS * ALIGN
LOCK_TTL = 30.0
GRACE = 5.0


def key(index: int) -> ObjectKey:
    return ObjectKey("reclaimable-in-grace", 0, index.to_bytes(8, "big"))


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    with L1Manager(
        CAPACITY, align=ALIGN, lock_ttl_s=LOCK_TTL, write_ttl_s=LOCK_TTL, prefault=False, lease_grace_s=GRACE
    ) as manager:
        yield manager


def store(l1: L1Manager, indices: range) -> None:
    keys = [key(index) for index in indices]
    for obj in l1.reserve_write(keys, [ALIGN] * len(keys)).values():
        l1.write_object(obj, memoryview(bytes(ALIGN)))
    assert all(l1.finish_write(keys))


def lapse_read_locks(l1: L1Manager, indices: range) -> float:
    """Read-lock the objects and reap the locks as if their holder crashed; returns the
    reap's clock, from which the grace period runs."""
    l1.reserve_read([key(index) for index in indices])
    reaped_at = time.monotonic() + 2 * LOCK_TTL
    assert l1.expire_locks(reaped_at) == len(indices)
    return reaped_at


def test_objects_in_their_grace_period_are_not_reclaimable(l1: L1Manager) -> None:
    store(l1, range(6))
    lapse_read_locks(l1, range(4))
    # 2 free blocks, 2 unlocked objects that eviction frees now; the 4 lapsed ones no
    # eviction frees before their grace period ends.
    assert l1.reclaimable_bytes() == 4 * ALIGN
    assert l1.unevictable_extents() == 4
    assert l1.reclaimable_spans() == [4 * ALIGN]
    # The figure is what evicting every unlocked object really leaves room for.
    l1.evict(CAPACITY, [key(index) for index in range(6)])
    with pytest.raises(L1OutOfMemoryError):
        l1.reserve_write([key(10)], [5 * ALIGN])
    assert l1.reserve_write([key(11)], [4 * ALIGN])


def test_a_locked_object_in_its_grace_period_is_counted_once(l1: L1Manager) -> None:
    store(l1, range(2))
    lapse_read_locks(l1, range(2))
    l1.reserve_read([key(0)])  # locked again: unevictable as a locked object
    assert l1.reclaimable_bytes() == CAPACITY - 2 * ALIGN
    assert l1.unevictable_extents() == 2


def test_objects_are_reclaimable_again_once_their_grace_period_ends(l1: L1Manager) -> None:
    store(l1, range(4))
    reaped_at = lapse_read_locks(l1, range(4))
    assert l1.reclaimable_bytes() == CAPACITY - 4 * ALIGN
    l1.expire_locks(reaped_at + GRACE + 1.0)  # forgets the grace periods over by then
    assert l1.reclaimable_bytes() == CAPACITY
    assert l1.unevictable_extents() == 0


def test_past_the_walk_limit_objects_in_their_grace_period_count_as_reclaimable(
    l1: L1Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The walk runs under the L1 lock for every write that finds L1 full: past its limit
    (a crashed client's many locks) the figure is the optimistic one, not a long walk."""
    monkeypatch.setattr(leases, "LAPSED_WALK_LIMIT", 3)
    store(l1, range(6))
    lapse_read_locks(l1, range(4))
    assert l1.reclaimable_bytes() == CAPACITY
    assert l1.unevictable_extents() == 0
