"""Leases: a locked extent never changes hands under its holder without its generation moving.

A forced delete quarantines the extents of read-locked objects until their readers release
them; an expired lock keeps its extent out of reach for the grace period; and every extent
that goes back to the allocator bumps its entry in the arena's generation table first.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object

ALIGN = 4096
CAPACITY = 16 * ALIGN
LOCK_TTL = 30.0
GRACE = 5.0


def key(index: int) -> ObjectKey:
    return ObjectKey("lease-model", 0, index.to_bytes(8, "big"))


def keys(*indices: int) -> list[ObjectKey]:
    return [key(index) for index in indices]


def make(nvme_dir: Path | None = None) -> L1Manager:
    return L1Manager(
        CAPACITY,
        align=ALIGN,
        lock_ttl_s=LOCK_TTL,
        write_ttl_s=LOCK_TTL,
        prefault=False,
        lease_grace_s=GRACE,
        nvme_path=None if nvme_dir is None else str(nvme_dir),
    )


@pytest.fixture(params=["memory", "nvme"])
def l1(request: pytest.FixtureRequest) -> Iterator[L1Manager]:
    manager = make(request.getfixturevalue("nvme_dir") if request.param == "nvme" else None)
    yield manager
    manager.close()


@pytest.fixture
def memory_l1() -> Iterator[L1Manager]:
    manager = make()
    yield manager
    manager.close()


def store(l1: L1Manager, indices: list[int], units: int = 1, fill: int | None = None) -> list[L1Object]:
    reserved = l1.reserve_write(keys(*indices), [units * ALIGN] * len(indices))
    for index, obj in zip(indices, reserved.values(), strict=True):
        l1.write_object(obj, memoryview(bytes([index % 256 if fill is None else fill]) * obj.size))
    assert all(l1.finish_write(list(reserved)))
    return list(reserved.values())


def read(l1: L1Manager, obj: L1Object) -> bytes:
    out = bytearray(obj.size)
    l1.read_object(obj, memoryview(out))
    return bytes(out)


def table_entry(l1: L1Manager, obj: L1Object) -> int:
    return int(l1.arena.generations[obj.offset // ALIGN])


def test_every_extent_going_back_moves_its_generation(memory_l1: L1Manager) -> None:
    l1 = memory_l1
    assert l1.arena.generation_block == ALIGN
    assert len(l1.arena.generations) == CAPACITY // ALIGN
    first, second = store(l1, [1, 2])
    before = l1.generations([first, second])
    assert before == [table_entry(l1, first), table_entry(l1, second)]
    assert l1.delete(keys(1)) == [True]
    assert l1.generations([first, second]) == [before[0] + 1, before[1]]
    assert l1.evict(ALIGN, keys(2)) == keys(2)
    assert table_entry(l1, second) == before[1] + 1
    (aborted,) = l1.reserve_write(keys(3), [ALIGN]).values()
    generation = table_entry(l1, aborted)
    l1.abort_write(keys(3))
    assert table_entry(l1, aborted) == generation + 1


def test_a_forced_delete_holds_read_locked_extents_until_released(l1: L1Manager) -> None:
    objects = store(l1, [1, 2, 3], units=4, fill=0xAB)
    l1.reserve_read(keys(1, 2), count=2)
    generations = l1.generations(objects)
    assert l1.clear(force=True) == 3
    assert len(l1) == 0
    # 3 was unlocked: its extent is free; 1 and 2 are quarantined with their two locks each
    stats = l1.lease_stats()
    assert (stats.quarantined_extents, stats.quarantined_bytes, stats.quarantined_forced) == (2, 8 * ALIGN, 2)
    assert l1.used_bytes == 8 * ALIGN and l1.reclaimable_bytes() == CAPACITY - 8 * ALIGN
    # new objects, even under the same keys, cannot get those extents
    fresh = store(l1, [1, 7], units=4, fill=0xCD)
    assert {obj.offset for obj in fresh}.isdisjoint({objects[0].offset, objects[1].offset})
    with pytest.raises(L1OutOfMemoryError):
        l1.reserve_write(keys(8), [2 * ALIGN])
    # the readers' copies still see their bytes
    assert read(l1, objects[0]) == bytes([0xAB]) * objects[0].size
    if l1.is_memory:
        assert l1.generations(objects[:2]) == generations[:2]
    # a release is credited to the quarantined extent before the new object of that key
    l1.finish_read(keys(1))
    new_one = l1.get(key(1))
    assert new_one is not None and new_one.read_locks == 0
    assert l1.lease_stats().quarantined_extents == 2
    l1.finish_read(keys(1, 2), count=2)
    stats = l1.lease_stats()
    assert (stats.quarantined_extents, stats.reclaimed_released, stats.reclaimed_bytes) == (0, 2, 8 * ALIGN)
    assert l1.used_bytes == 8 * ALIGN  # only the two new objects
    if l1.is_memory:
        assert [table_entry(l1, obj) for obj in objects[:2]] == [gen + 1 for gen in generations[:2]]


def test_a_forced_extent_goes_back_at_the_end_of_its_readers_lease(l1: L1Manager) -> None:
    (obj,) = store(l1, [1])
    l1.reserve_read(keys(1))
    deadline = obj.lock_deadline
    l1.clear(force=True)
    assert l1.expire_locks(deadline - 1) == 0
    assert l1.lease_stats().quarantined_extents == 1
    l1.expire_locks(deadline + 1)
    stats = l1.lease_stats()
    assert (stats.quarantined_extents, stats.reclaimed_lease_end) == (0, 1)
    assert l1.used_bytes == 0
    l1.finish_read(keys(1))  # the reader that never came back is harmless now


def test_a_reader_of_an_extent_pinned_by_a_store_never_releases_a_later_object_of_its_key(
    l1: L1Manager,
) -> None:
    store(l1, [1], fill=0x01)
    stored = list(l1.reserve_store(keys(1)).values())  # an L2 store copies the object out
    l1.reserve_read(keys(1))  # and a reader holds it
    assert l1.clear(force=True) == 1
    (new,) = store(l1, [1], fill=0x02)
    l1.reserve_read(keys(1))  # a reader of the new object
    l1.finish_read(keys(1))  # the old object's reader is done: credited to its extent
    assert new.read_locks == 1, "the old reader's release unlocked the new object"
    assert l1.evict(ALIGN, keys(1)) == [], "a read-locked object was evicted"
    assert read(l1, new) == bytes([0x02]) * ALIGN
    assert l1.used_bytes == 2 * ALIGN  # the old extent is pinned for the store
    l1.finish_store(stored)
    assert l1.used_bytes == ALIGN and l1.lease_stats().quarantined_extents == 0
    l1.finish_read(keys(1))
    assert new.read_locks == 0


def test_an_extent_pinned_by_a_store_outlasts_its_readers_lease(
    l1: L1Manager,
) -> None:
    old, other = store(l1, [1, 2], fill=0x0A)
    stored = list(l1.reserve_store(keys(1, 2)).values())
    l1.reserve_read(keys(1))
    generations = l1.generations([old, other])
    l1.clear(force=True)
    assert l1.used_bytes == 2 * ALIGN and l1.reclaimable_bytes() == CAPACITY - 2 * ALIGN
    assert read(l1, old) == bytes([0x0A]) * ALIGN  # the store still reads its bytes
    # 1's reader never comes back: its lease ends, the store's pin does not
    l1.expire_locks(float("inf"))
    assert l1.used_bytes == 2 * ALIGN
    if l1.is_memory:
        assert l1.generations([old, other]) == generations
    l1.finish_store(stored)
    assert l1.used_bytes == 0 and l1.lease_stats().quarantined_bytes == 0


def test_readers_of_an_extent_pinned_by_a_store_keep_it_after_the_store_reports(l1: L1Manager) -> None:
    store(l1, [1])
    stored = list(l1.reserve_store(keys(1)).values())
    l1.reserve_read(keys(1), count=2)
    l1.clear(force=True)
    l1.finish_store(stored)
    assert l1.used_bytes == ALIGN, "the store let go, its readers did not"
    l1.finish_read(keys(1))
    assert l1.used_bytes == ALIGN
    l1.finish_read(keys(1))
    assert l1.used_bytes == 0


def test_expired_read_locks_keep_their_extent_for_the_grace_period(l1: L1Manager) -> None:
    (obj,) = store(l1, [1], fill=0x11)
    l1.reserve_read(keys(1))
    expired_at = obj.lock_deadline + 1
    assert l1.expire_locks(expired_at) == 1
    assert obj.read_locks == 0 and l1.lease_stats().lapsed_objects == 1
    # the object is evictable again, but its extent stays out of reach for a while
    assert l1.evict(ALIGN, keys(1)) == keys(1)
    assert l1.lease_stats().quarantined_expired == 1
    assert l1.reclaimable_bytes() == CAPACITY - ALIGN
    assert read(l1, obj) == bytes([0x11]) * ALIGN  # the slow reader still reads its bytes
    l1.expire_locks(expired_at + GRACE + 1)
    assert l1.used_bytes == 0 and l1.lease_stats().lapsed_objects == 0


def test_readers_releasing_a_forced_extent_do_not_cut_short_an_expired_lock_grace_period(
    l1: L1Manager,
) -> None:
    (obj,) = store(l1, [1], fill=0x11)
    l1.reserve_read(keys(1))  # a reader too slow for its lock TTL
    expired_at = obj.lock_deadline + 1
    assert l1.expire_locks(expired_at) == 1
    l1.reserve_read(keys(1))  # another reader, in time
    generations = l1.generations([obj])
    assert l1.clear(force=True) == 1
    l1.finish_read(keys(1))  # the reader in time lets go
    # the slow reader's grace period has not ended: the extent is still out of reach
    assert l1.lease_stats().quarantined_extents == 1 and l1.used_bytes == ALIGN
    assert l1.generations([obj]) == generations
    assert read(l1, obj) == bytes([0x11]) * ALIGN
    l1.expire_locks(expired_at + GRACE + 1)
    assert l1.used_bytes == 0 and l1.lease_stats().quarantined_extents == 0


def test_making_room_does_not_count_extents_held_back_for_an_expired_lock_as_freed(
    l1: L1Manager,
) -> None:
    objects = store(l1, list(range(CAPACITY // ALIGN)))  # L1 is full
    l1.reserve_read(keys(0))
    assert l1.expire_locks(objects[0].lock_deadline + 1) == 1
    # evicting 0 frees nothing for the grace period: the next victim must go too
    assert l1.make_room(ALIGN, keys(0, 1, 2)).keys == keys(0, 1)
    assert l1.used_bytes == CAPACITY - ALIGN
    assert list(l1.reserve_write(keys(100), [ALIGN])) == keys(100)


def test_an_extent_held_back_for_a_moment_is_not_made_up_for_with_unstored_objects(
    l1: L1Manager,
) -> None:
    # Each unstored object evicted loses an acknowledged write: the last resort is not
    # taken for room that comes back at the end of the grace period.
    objects = store(l1, list(range(CAPACITY // ALIGN)))
    l1.mark_unstored(keys(1))
    l1.reserve_read(keys(0))
    assert l1.expire_locks(objects[0].lock_deadline + 1) == 1
    eviction = l1.make_room(ALIGN, keys(0, 1))
    assert eviction.keys == keys(0) and eviction.unstored == []


def test_an_object_leaving_after_its_grace_period_is_freed_at_once(l1: L1Manager) -> None:
    (obj,) = store(l1, [1])
    l1.reserve_read(keys(1))
    l1.expire_locks(obj.lock_deadline + 1)
    l1.expire_locks(obj.lock_deadline + GRACE + 2)  # the lapse is forgotten
    assert l1.delete(keys(1)) == [True]
    assert l1.used_bytes == 0 and l1.lease_stats().quarantined_expired == 0


def test_a_full_l1_reclaims_ended_leases_before_refusing_a_reservation() -> None:
    with L1Manager(CAPACITY, align=ALIGN, lock_ttl_s=0.2, prefault=False, lease_grace_s=0.1) as l1:
        store(l1, list(range(16)))
        l1.reserve_read(keys(*range(16)))
        l1.clear(force=True)
        with pytest.raises(L1OutOfMemoryError):
            l1.reserve_write(keys(100), [ALIGN])
        time.sleep(0.4)  # past the readers' lease (lock TTL 0.2 s; grace 0.1 s)
        # nobody reaped the quarantine meanwhile: the reservation itself does
        assert list(l1.reserve_write(keys(100), [ALIGN])) == keys(100)
        assert l1.lease_stats().reclaimed_lease_end == 16


def test_writers_are_never_forced_out(l1: L1Manager) -> None:
    (reserved,) = l1.reserve_write(keys(1), [ALIGN]).values()
    assert l1.delete(keys(1), force=True) == [False]
    assert l1.clear(force=True) == 0
    l1.write_object(reserved, memoryview(b"w" * ALIGN))
    assert l1.finish_write(keys(1)) == [True]
    assert read(l1, reserved) == b"w" * ALIGN


def test_reclaimable_bytes_counts_free_and_unlocked(l1: L1Manager) -> None:
    store(l1, [1, 2, 3], units=2)
    l1.reserve_write(keys(4), [ALIGN])
    l1.reserve_read(keys(2))
    # 1 and 3 may be evicted; 2 is read, 4 is being written
    assert l1.reclaimable_bytes() == CAPACITY - 3 * ALIGN


def test_a_generation_entry_at_its_largest_value_wraps_and_the_extent_goes_back(memory_l1: L1Manager) -> None:
    # Clients map the table writable: one holding 2**64 - 1 must not make a release raise.
    l1 = memory_l1
    (obj,) = store(l1, [1])
    l1.arena.generations[obj.offset // ALIGN] = (1 << 64) - 1
    assert l1.delete(keys(1)) == [True]
    assert table_entry(l1, obj) == 0
    assert len(store(l1, list(range(2, 18)))) == CAPACITY // ALIGN  # every extent free again


def test_an_nvme_l1_reports_no_generations(nvme_dir: Path) -> None:
    with make(nvme_dir) as l1:
        objects = store(l1, [1, 2])
        assert l1.generations(objects) == [0, 0]


def test_a_store_lends_an_object_deleted_by_force_after_it_locked_it(l1: L1Manager) -> None:
    store(l1, [1], fill=0x01)
    stored = list(l1.reserve_store(keys(1)).values())
    l1.clear(force=True)  # before the store got to copying the object out
    assert bytes(l1.lend(stored[0]).buffer) == bytes([0x01]) * ALIGN
    l1.finish_store(stored)
    assert l1.used_bytes == 0
    with pytest.raises(KeyError):
        l1.lend(stored[0])  # nobody holds the extent any more


class ForceDeleteOnRead:
    """A listener that deletes by force the objects it is told were read, once armed: what
    a CLEAR from another thread does when it lands right after a store locked them."""

    def __init__(self, l1: L1Manager) -> None:
        self.l1 = l1
        self.armed = False

    def on_l1_keys_written(self, keys: object) -> None:
        pass

    def on_l1_keys_read(self, keys: list[ObjectKey]) -> None:
        if self.armed:
            self.armed = False
            self.l1.delete(list(keys), force=True)

    def on_l1_keys_deleted(self, keys: object) -> None:
        pass


def test_an_object_deleted_by_force_as_a_store_locks_it_is_pinned_for_the_store_only(l1: L1Manager) -> None:
    store(l1, [1], fill=0x01)
    deleter = ForceDeleteOnRead(l1)
    l1.add_listener(deleter)
    deleter.armed = True
    stored = list(l1.reserve_store(keys(1)).values())
    assert l1.get(key(1)) is None, "the listener's forced delete did not happen"
    assert read(l1, stored[0]) == bytes([0x01]) * ALIGN  # the store still reads its bytes
    (new,) = store(l1, [1], fill=0x02)
    l1.reserve_read(keys(1))
    l1.finish_read(keys(1))  # the new object's reader: nothing else holds the key
    assert new.read_locks == 0, "a reader's release was credited to the store's extent"
    l1.finish_store(stored)
    assert l1.used_bytes == ALIGN, "the store let go: its extent goes back"
    assert l1.lease_stats().quarantined_extents == 0


def reuse_under_reader(l1: L1Manager, obj: L1Object) -> L1Object:
    """While a reader still holds ``obj`` (key 1), a forced clear, a new object of key 1
    whose reader's release is credited to ``obj``'s extent, and a new object in that extent."""
    l1.clear(force=True)
    store(l1, [1], fill=0x02)
    l1.reserve_read(keys(1))
    l1.finish_read(keys(1))  # credited to the quarantined extent: it goes back
    (intruder,) = store(l1, [2], fill=0x03)
    assert intruder.offset == obj.offset, "the test needs the extent to be reused"
    return intruder


@pytest.mark.parametrize("copy", ["read_object", "lend"])
def test_a_copy_whose_extent_changed_hands_meanwhile_is_refused(
    l1: L1Manager, copy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    (obj,) = store(l1, [1], fill=0x01)
    l1.reserve_read(keys(1))
    if copy == "lend" and l1.is_memory:
        loan = l1.lend(obj)  # the extent itself: copied out by detach()
        reuse_under_reader(l1, obj)
        with pytest.raises(KeyError):
            loan.detach()  # would hold another object's bytes as key 1's
        return
    backing = l1._backing
    read_into = backing.read_into

    def racing_read(offset: int, size: int, out: memoryview) -> None:
        monkeypatch.setattr(backing, "read_into", read_into)
        reuse_under_reader(l1, obj)  # lands while the bytes are being copied out
        read_into(offset, size, out)

    monkeypatch.setattr(backing, "read_into", racing_read)
    with pytest.raises(KeyError):
        if copy == "lend":
            l1.lend(obj).detach()
        else:
            l1.read_object(obj, memoryview(bytearray(obj.size)))


def test_an_earlier_holds_lease_end_does_not_cut_short_the_grace_period_of_the_extents_next_object() -> None:
    # One extent: a forced delete holds it for a reader, whose release gives it back before
    # that hold's lease end; the next object there is a write reservation past its TTL, held
    # for a grace period that ends later.  The earlier hold's end comes up first and must
    # not give back the later one's extent.
    grace = 60.0
    with L1Manager(
        ALIGN, align=ALIGN, lock_ttl_s=LOCK_TTL, write_ttl_s=1.0, prefault=False, lease_grace_s=grace
    ) as l1:
        (first,) = store(l1, [1])
        l1.reserve_read(keys(1))
        assert l1.clear(force=True) == 1
        l1.finish_read(keys(1))
        assert l1.lease_stats().reclaimed_released == 1 and l1.used_bytes == 0
        (second,) = l1.reserve_write(keys(2), [ALIGN]).values()
        assert second.offset == first.offset
        expired_at = second.lock_deadline
        assert l1.expire_locks(expired_at) == 1
        # Past the forced hold's lease end (at most ``grace`` after the clear, which was
        # before ``second`` was reserved), before ``second``'s grace period ends.
        l1.expire_locks(expired_at + grace - 0.5)
        stats = l1.lease_stats()
        assert (stats.quarantined_extents, stats.reclaimed_lease_end) == (1, 0), "held for its grace period"
        assert l1.used_bytes == ALIGN
        l1.expire_locks(expired_at + grace + 0.5)
        stats = l1.lease_stats()
        assert (stats.quarantined_extents, stats.reclaimed_lease_end, l1.used_bytes) == (0, 1, 0)
