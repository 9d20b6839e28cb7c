"""Batched write steps of L1: a reservation's objects are inserted, made READY and
indexed a batch at a time; these pin what the per-key steps they replace guaranteed."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, ObjectState

ALIGN = 4096
CAPACITY = 64 * ALIGN
WRITE_TTL = 60.0


def key(index: int) -> ObjectKey:
    return ObjectKey("write-batches", 0, index.to_bytes(8, "big"))


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(CAPACITY, align=ALIGN, lock_ttl_s=30.0, write_ttl_s=WRITE_TTL, prefault=False)
    yield manager
    manager.close()


def test_a_key_repeated_in_a_commit_is_committed_once(l1: L1Manager) -> None:
    first, second = key(1), key(2)
    l1.reserve_write([first, second], [ALIGN, ALIGN])
    assert l1.finish_write([first, first, second]) == [True, False, True]
    assert l1.prefix_hits([first, second]) == 2
    assert l1.stats().write_locked == 0
    assert l1.stats().read_locks == 0
    assert l1.evict(2 * ALIGN, [first, second]) == [first, second], "committed objects stay locked"


def test_finish_reserved_commits_only_the_reservations_still_in_l1(l1: L1Manager) -> None:
    kept, reaped = key(1), key(2)
    reserved = l1.reserve_write([kept, reaped], [ALIGN, 2 * ALIGN])
    l1.expire_locks(reserved[reaped].lock_deadline + 1)  # reaps both: reserve kept anew
    assert l1.get(kept) is None and l1.get(reaped) is None
    again = l1.reserve_write([kept], [ALIGN])
    newer = l1.reserve_write([reaped], [2 * ALIGN])
    assert l1.finish_reserved(reserved) == [], "another writer's reservation is not committed"
    assert l1.get(reaped) is newer[reaped]
    assert newer[reaped].state is ObjectState.WRITING
    assert l1.finish_reserved(again) == [again[kept]]
    assert again[kept].state is ObjectState.READY
    assert l1.finish_reserved(again) == [], "a reservation is committed once"
    assert l1.prefix_hits([kept, reaped]) == 1


def test_a_batch_of_temporary_reservations_is_freed_after_its_last_read(l1: L1Manager) -> None:
    batch = [key(index) for index in range(4)]
    reserved = l1.reserve_write(batch, [ALIGN, 3 * ALIGN, ALIGN, 3 * ALIGN], temporary=True)
    assert l1.stats().temporary == 4
    assert [obj.size for obj in reserved.values()] == [ALIGN, 3 * ALIGN, ALIGN, 3 * ALIGN]
    assert l1.used_bytes == 8 * ALIGN
    assert l1.finish_write_and_reserve_read(batch) == [True] * 4
    l1.finish_read(batch)
    assert len(l1) == 0 and l1.used_bytes == 0


def test_a_negative_size_anywhere_in_a_batch_reserves_nothing(l1: L1Manager) -> None:
    with pytest.raises(ValueError, match="must not be negative"):
        l1.reserve_write([key(1), key(2), key(3)], [ALIGN, ALIGN, -1])
    assert len(l1) == 0 and l1.used_bytes == 0
