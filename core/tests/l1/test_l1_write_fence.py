"""The write fence: an expired reservation whose writer copies into the shared arena itself
is never reused until that writer says it stopped copying.

A client checks its reservation's generation, then copies.  Stalled between the two for
longer than the write TTL and the lease grace, its copy would land in whatever object the
extent was handed to since.  The clock is driven through ``expire_locks(now)``: no sleeps.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object

ALIGN = 4096
UNITS = 4
TTL = 30.0
GRACE = 5.0


def key(index: int) -> ObjectKey:
    return ObjectKey("write-fence", 0, index.to_bytes(8, "big"))


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(
        UNITS * ALIGN, align=ALIGN, lock_ttl_s=TTL, write_ttl_s=TTL, prefault=False, lease_grace_s=GRACE
    )
    yield manager
    manager.close()


def reserve_fenced(l1: L1Manager, index: int) -> L1Object:
    reserved = l1.reserve_write([key(index)], [ALIGN])
    assert l1.fence_writers(list(reserved.values())) == []
    return reserved[key(index)]


def store_until_full(l1: L1Manager, first: int) -> list[L1Object]:
    """Store objects (each filled with its own byte) until L1 refuses one."""
    stored: list[L1Object] = []
    for index in range(first, first + UNITS + 1):
        try:
            obj = l1.reserve_write([key(index)], [ALIGN])[key(index)]
        except L1OutOfMemoryError:
            break
        l1.write_object(obj, memoryview(bytes([index]) * ALIGN))
        assert l1.finish_write([key(index)]) == [True]
        stored.append(obj)
    return stored


def read(l1: L1Manager, obj: L1Object) -> bytes:
    out = bytearray(obj.size)
    l1.read_object(obj, memoryview(out))
    return bytes(out)


def past_ttl_and_grace(obj: L1Object) -> float:
    return obj.lock_deadline + GRACE + 1.0


def test_a_late_write_of_an_expired_reservation_never_lands_in_another_object(l1: L1Manager) -> None:
    stalled = reserve_fenced(l1, 1)
    # The writer checked its generation (unchanged) and stalls; its reservation expires,
    # and the grace period of the expired lock ends too.
    assert l1.expire_locks(stalled.lock_deadline) == 1
    l1.expire_locks(past_ttl_and_grace(stalled))
    assert l1.get(key(1)) is None  # the key is free for other writers
    others = store_until_full(l1, 10)
    assert len(others) == UNITS - 1  # the fenced extent is not handed out
    assert stalled.offset not in {obj.offset for obj in others}

    l1.arena.write_from(stalled.offset, memoryview(b"\xee" * ALIGN))  # the late copy

    for obj in others:
        assert read(l1, obj) == bytes([obj.key.chunk_hash[-1]]) * ALIGN
    stats = l1.lease_stats()
    assert (stats.fenced_extents, stats.fenced_bytes, stats.quarantined_fenced) == (1, ALIGN, 1)


def test_the_writers_commit_or_abort_gives_the_fenced_extent_back(l1: L1Manager) -> None:
    stalled = reserve_fenced(l1, 1)
    generation = l1.generations([stalled])[0]
    l1.expire_locks(stalled.lock_deadline)
    l1.expire_locks(past_ttl_and_grace(stalled))
    l1.expire_locks(past_ttl_and_grace(stalled) + 3600.0)  # no lease end frees it
    assert l1.lease_stats().fenced_extents == 1

    assert l1.writers_done([stalled]) == 1
    assert l1.writers_done([stalled]) == 0  # once
    # A reader comparing generations would see the extent changed hands.
    assert l1.generations([stalled])[0] != generation
    assert len(store_until_full(l1, 10)) == UNITS
    stats = l1.lease_stats()
    assert (stats.fenced_extents, stats.fenced_bytes, stats.reclaimed_writer_done) == (0, 0, 1)
    assert stats.quarantined_bytes == 0


def test_a_writer_done_before_the_reap_leaves_only_the_usual_grace(l1: L1Manager) -> None:
    stalled = reserve_fenced(l1, 1)
    assert l1.writers_done([stalled]) == 0  # still being written: nothing to give back
    l1.expire_locks(stalled.lock_deadline)
    l1.expire_locks(past_ttl_and_grace(stalled))
    assert l1.lease_stats().fenced_extents == 0
    assert len(store_until_full(l1, 10)) == UNITS


def test_an_aborted_reservation_is_not_fenced(l1: L1Manager) -> None:
    reserve_fenced(l1, 1)
    l1.abort_write([key(1)])
    assert l1.lease_stats().fenced_extents == 0
    assert len(store_until_full(l1, 10)) == UNITS


def test_a_reservation_reaped_before_it_is_fenced_is_reported_gone(l1: L1Manager) -> None:
    reserved = l1.reserve_write([key(1)], [ALIGN])
    obj = reserved[key(1)]
    l1.expire_locks(obj.lock_deadline)
    assert l1.fence_writers([obj]) == [obj]


def test_a_writer_done_with_an_unfenced_expired_reservation_leaves_its_grace_period(l1: L1Manager) -> None:
    # Reaped before its front end fenced it, its writer's commit or abort still names it:
    # only a fenced extent goes back then, this one is held for its grace period like any.
    obj = l1.reserve_write([key(1)], [ALIGN])[key(1)]
    assert l1.expire_locks(obj.lock_deadline) == 1
    assert l1.fence_writers([obj]) == [obj]
    assert l1.writers_done([obj]) == 0
    assert len(store_until_full(l1, 10)) == UNITS - 1, "its extent was reused in its grace period"
    l1.expire_locks(past_ttl_and_grace(obj))
    stats = l1.lease_stats()
    assert (stats.quarantined_extents, stats.reclaimed_lease_end, stats.reclaimed_writer_done) == (0, 1, 0)
