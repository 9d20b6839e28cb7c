"""The quarantine's books: every L1 extent counted as given back was first counted as held
back (``l1_quarantined_total`` by reason, ``l1_quarantine_reclaimed_total`` by how), so once
nothing is held the two sums are equal, whatever took the objects away."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object

ALIGN = 4096
LOCK_TTL = 30.0


def keys(*indices: int) -> list[ObjectKey]:
    return [ObjectKey("quarantine-books", 0, index.to_bytes(8, "big")) for index in indices]


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(
        16 * ALIGN, align=ALIGN, lock_ttl_s=LOCK_TTL, write_ttl_s=LOCK_TTL, prefault=False, lease_grace_s=5.0
    )
    yield manager
    manager.close()


def store(l1: L1Manager, *indices: int) -> list[L1Object]:
    reserved = l1.reserve_write(keys(*indices), [ALIGN] * len(indices))
    for obj in reserved.values():
        l1.write_object(obj, memoryview(b"\x01" * obj.size))
    assert all(l1.finish_write(list(reserved)))
    return list(reserved.values())


def books(l1: L1Manager) -> tuple[int, int]:
    """(extents counted as held back, extents counted as given back)"""
    stats = l1.lease_stats()
    held = stats.quarantined_forced + stats.quarantined_dropped + stats.quarantined_expired
    return held, stats.reclaimed_released + stats.reclaimed_lease_end


def test_an_extent_a_forced_clear_leaves_to_its_l2_store_is_counted_held_and_given_back(
    l1: L1Manager,
) -> None:
    store(l1, 1, 2)
    stored = list(l1.reserve_store(keys(1, 2)).values())  # an L2 store is copying them out
    assert l1.clear(force=True) == 2  # their extents stay until the store reports
    assert l1.lease_stats().quarantined_extents == 2
    held, _ = books(l1)
    assert held == 2, "extents held back for an L2 store were not counted as quarantined"
    l1.finish_store(stored)
    stats = l1.lease_stats()
    assert stats.quarantined_extents == 0 and stats.quarantined_bytes == 0
    assert books(l1) == (2, 2)
    assert stats.reclaimed_bytes == 2 * ALIGN


def test_a_forced_clear_of_objects_read_and_stored_counts_each_extent_once(l1: L1Manager) -> None:
    store(l1, 1, 2)
    stored = list(l1.reserve_store(keys(1, 2)).values())
    l1.reserve_read(keys(1))  # a reader holds 1 as well
    l1.clear(force=True)
    l1.finish_read(keys(1))
    l1.finish_store(stored)
    assert l1.lease_stats().quarantined_extents == 0
    assert books(l1) == (2, 2)
