"""L1Manager's hand-offs with L2: unstored objects evicted last, load reservations owned by
their prefetch, and loans of object bytes that work on both backings."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object

ALIGN = 4096
CAPACITY = 16 * ALIGN


def key(index: int) -> ObjectKey:
    return ObjectKey("handoff-test", 0, index.to_bytes(8, "big"))


def keys(*indices: int) -> list[ObjectKey]:
    return [key(index) for index in indices]


def pattern(obj: L1Object) -> bytes:
    return bytes([obj.key.chunk_hash[-1]]) * obj.size


@pytest.fixture(params=["memory", "nvme"])
def l1(request: pytest.FixtureRequest) -> Iterator[L1Manager]:
    nvme_dir: Path | None = request.getfixturevalue("nvme_dir") if request.param == "nvme" else None
    manager = L1Manager(
        CAPACITY, align=ALIGN, prefault=False, nvme_path=None if nvme_dir is None else str(nvme_dir)
    )
    yield manager
    manager.close()


def write(l1: L1Manager, *indices: int) -> list[L1Object]:
    reserved = l1.reserve_write(keys(*indices), [ALIGN] * len(indices))
    for obj in reserved.values():
        loan = l1.lend(obj, fill=True)
        loan.buffer[:] = pattern(obj)
        loan.commit()
    assert all(l1.finish_write(list(reserved)))
    return list(reserved.values())


# -- unstored objects ------------------------------------------------------------------------


def test_unstored_objects_are_evicted_only_when_nothing_else_makes_room(l1: L1Manager) -> None:
    write(l1, 1, 2, 3, 4)
    marked = l1.mark_unstored(keys(1, 2))
    assert [obj.key for obj in marked] == keys(1, 2)
    # Stored objects go first, even when they come later in victim order.
    eviction = l1.make_room(2 * ALIGN, keys(1, 2, 3, 4))
    assert (eviction.keys, eviction.unstored) == (keys(3, 4), [])
    # Nothing else left: the unstored ones go too, in victim order, and are reported.
    eviction = l1.make_room(ALIGN, keys(2, 1))
    assert (eviction.keys, eviction.unstored) == (keys(2), keys(2))
    assert l1.make_room(ALIGN, keys(1), spare_unstored=True) == ([], [])
    assert l1.evict(ALIGN, keys(1)) == keys(1)  # evict() is make_room's last resort too


def test_settled_objects_are_evictable_like_any_and_a_new_object_starts_clean(l1: L1Manager) -> None:
    (first,) = write(l1, 1)
    l1.mark_unstored(keys(1))
    assert l1.make_room(ALIGN, keys(1), spare_unstored=True).keys == []
    l1.settle_unstored([first])
    assert l1.make_room(ALIGN, keys(1), spare_unstored=True).keys == keys(1)
    # A flag belongs to its object, not its key: settling an old object never touches
    # the object that took its key since, and a new object is not unstored by inheritance.
    (old,) = write(l1, 2)
    l1.mark_unstored(keys(2))
    assert l1.delete(keys(2)) == [True]
    (new,) = write(l1, 2)
    assert l1.make_room(ALIGN, keys(2), spare_unstored=True).keys == keys(2)
    (again,) = write(l1, 2)
    l1.mark_unstored(keys(2))
    l1.settle_unstored([old, new])
    assert l1.make_room(ALIGN, keys(2), spare_unstored=True).keys == []
    assert again.unstored


def test_unstored_bytes_count_the_objects_l1_holds_stored_nowhere_yet(l1: L1Manager) -> None:
    first, second, third, fourth = write(l1, 1, 2, 3, 4)
    l1.mark_unstored(keys(1, 2, 3, 4))
    l1.mark_unstored(keys(1))  # flagged already: counted once
    assert l1.unstored_bytes == 4 * ALIGN
    l1.settle_unstored([first])  # stored in an adapter
    assert l1.unstored_bytes == 3 * ALIGN
    assert l1.evict(ALIGN, keys(2)) == keys(2)  # its bytes leave L1 with it
    assert l1.delete(keys(3)) == [True]
    assert l1.unstored_bytes == ALIGN
    # Settling objects that left L1 (their stores report afterwards) takes nothing twice.
    l1.settle_unstored([first, second, third])
    assert l1.unstored_bytes == ALIGN
    l1.clear()
    assert l1.unstored_bytes == 0
    l1.settle_unstored([fourth])
    assert l1.unstored_bytes == 0


def test_locked_and_writing_objects_are_never_victims(l1: L1Manager) -> None:
    write(l1, 1)
    l1.mark_unstored(keys(1))
    l1.reserve_read(keys(1))
    l1.reserve_write(keys(2), [ALIGN])
    assert l1.make_room(CAPACITY, keys(1, 2)) == ([], [])
    l1.finish_read(keys(1))
    assert l1.make_room(CAPACITY, keys(1, 2)) == (keys(1), keys(1))


# -- load reservations -------------------------------------------------------------------------


def test_a_writer_never_commits_or_aborts_a_prefetch_reservation(l1: L1Manager) -> None:
    loads = l1.reserve_load(keys(1, 2), [ALIGN, ALIGN], temporary=True)
    assert l1.finish_write(keys(1)) == [False]
    assert l1.finish_write_and_reserve_read(keys(1)) == [False]
    l1.abort_write(keys(1, 2))
    assert l1.contains(key(1)) and l1.contains(key(2))
    assert l1.prefix_hits(keys(1, 2)) == 0, "nothing readable before the load is finished"
    assert l1.finish_load([loads[key(1)]], count=2) == [True]
    assert l1.get(key(1)).read_locks == 2  # type: ignore[union-attr]
    l1.abort_load([loads[key(1)], loads[key(2)]])  # READY ones are not aborted
    assert l1.contains(key(1)) and not l1.contains(key(2))
    assert l1.stats().write_locked == 0


def test_a_finished_load_locks_on_the_lock_grid_as_every_read_lock(l1: L1Manager) -> None:
    # A front end's session computes its deadline for a prefetch's locks from a time read
    # before L1 takes them, on the same grid: one off the grid could be earlier than the
    # session's, which would then release a lock L1 reaped (dropping another holder's).
    before = time.monotonic()
    loads = l1.reserve_load(keys(1), [ALIGN], temporary=True)
    assert l1.finish_load([loads[key(1)]]) == [True]
    after = time.monotonic()
    obj = l1.get(key(1))
    assert obj is not None and obj.read_locks == 1
    assert obj.lock_deadline in (l1.lock_deadline(before), l1.lock_deadline(after))


def test_load_hand_off_is_by_identity(l1: L1Manager) -> None:
    loads = l1.reserve_load(keys(1), [ALIGN], temporary=True)
    stale = loads[key(1)]
    assert l1.delete(keys(1), force=True) == [False]  # forced deletes leave writes alone...
    assert l1.expire_locks(now=float("inf")) == 1  # ...the write TTL takes the reservation
    (writer,) = l1.reserve_write(keys(1), [ALIGN]).values()
    # The prefetch's late hand-off and clean-up leave the writer's object alone.
    assert l1.finish_load([stale]) == [False]
    l1.abort_load([stale])
    assert l1.get(key(1)) is writer and writer.state.value == "writing"
    assert l1.finish_write(keys(1)) == [True]


# -- loans ----------------------------------------------------------------------------------------


def test_loans_read_and_fill_every_backing(l1: L1Manager) -> None:
    (obj,) = write(l1, 7)
    loan = l1.lend(obj)
    assert bytes(loan.buffer) == pattern(obj)
    kept = loan.detach()
    assert bytes(kept) == pattern(obj)
    with pytest.raises(ValueError, match="not being written"):
        l1.lend(obj, fill=True)
    (fresh,) = l1.reserve_write(keys(8), [ALIGN]).values()
    fill = l1.lend(fresh, fill=True)
    fill.buffer[:] = b"\x5a" * ALIGN
    fill.commit()
    assert l1.finish_write(keys(8)) == [True]
    assert bytes(l1.lend(fresh).buffer) == b"\x5a" * ALIGN
    l1.delete(keys(7))
    with pytest.raises(KeyError):
        l1.lend(obj)


def test_a_memory_loan_for_reading_is_read_only_and_detach_copies(l1: L1Manager) -> None:
    (obj,) = write(l1, 3)
    loan = l1.lend(obj)
    if l1.is_memory:
        assert loan.buffer.readonly
        kept = loan.detach()
        assert kept is not loan.buffer and bytes(kept) == pattern(obj)
    else:
        assert loan.detach() is loan.buffer  # already a private staged copy


def test_a_load_reservation_taken_away_keeps_its_extent_until_the_load_lets_go(l1: L1Manager) -> None:
    forced = l1.reserve_load(keys(1), [ALIGN], temporary=True)[key(1)]
    expired = l1.reserve_load(keys(2), [ALIGN], temporary=True)[key(2)]
    assert l1.delete(keys(1), force=True) == [False]  # being written: never taken by force
    assert l1.expire_locks(now=float("inf")) == 2
    assert not l1.contains(key(1)) and not l1.contains(key(2))
    assert l1.used_bytes == 2 * ALIGN, "extents an adapter may still write into stay allocated"
    (writer,) = l1.reserve_write(keys(1), [ALIGN]).values()
    assert writer.offset not in (forced.offset, expired.offset)
    l1.abort_load([forced, expired])
    assert l1.used_bytes == ALIGN
    l1.abort_load([forced])  # given back once only
    assert l1.used_bytes == ALIGN


def test_an_extent_held_for_a_load_is_not_reclaimable(l1: L1Manager) -> None:
    (loading,) = l1.reserve_load(keys(1), [4 * ALIGN], temporary=False).values()
    assert l1.expire_locks(now=float("inf")) == 1
    assert not l1.contains(key(1)) and l1.used_bytes == 4 * ALIGN
    # neither free nor in an object that eviction could take
    assert l1.reclaimable_bytes() == CAPACITY - 4 * ALIGN
    l1.abort_load([loading])
    assert l1.reclaimable_bytes() == CAPACITY
