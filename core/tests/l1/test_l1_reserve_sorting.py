"""How a write reservation sorts out its keys: a batch of fresh keys, each named once (the
usual store), takes no per-key look-up; a batch with a repeated key, a stored key or
another writer's reservation reserves what the per-key rules say."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, ObjectState

ALIGN = 4096
CAPACITY = 64 * ALIGN


def key(index: int) -> ObjectKey:
    return ObjectKey("reserve-sorting", 0, index.to_bytes(8, "big"))


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(CAPACITY, align=ALIGN, lock_ttl_s=30.0, write_ttl_s=60.0, prefault=False)
    yield manager
    manager.close()


class _CountedGets(dict[Any, Any]):
    """The table's object map, counting the keys looked up one by one."""

    gets = 0

    def get(self, *args: Any) -> Any:
        _CountedGets.gets += 1
        return super().get(*args)


def test_a_batch_of_fresh_keys_is_reserved_without_a_look_up_per_key(l1: L1Manager) -> None:
    table = l1._table
    table.objects = _CountedGets(table.objects)
    _CountedGets.gets = 0
    batch = [key(index) for index in range(16)]
    reserved = l1.reserve_write(batch, [ALIGN] * 16, layouts=["uint8[4096]"] * 16)
    assert _CountedGets.gets == 0
    assert list(reserved) == batch
    assert all(l1.get(name) is reserved[name] for name in batch)


def test_fresh_keys_keep_their_own_sizes_and_layouts(l1: L1Manager) -> None:
    batch = [key(index) for index in range(3)]
    reserved = l1.reserve_write(batch, [ALIGN, 3 * ALIGN, 100], layouts=["uint8[4096]", "", "uint8[100]"])
    assert [obj.size for obj in reserved.values()] == [ALIGN, 3 * ALIGN, 100]
    assert [obj.extent_bytes for obj in reserved.values()] == [ALIGN, 3 * ALIGN, ALIGN]
    assert [obj.layout for obj in reserved.values()] == ["uint8[4096]", "", "uint8[100]"]
    assert all(obj.state is ObjectState.WRITING for obj in reserved.values())
    assert l1.stats().write_locked == 3


def test_a_repeated_key_is_reserved_once_at_its_first_size_and_layout(l1: L1Manager) -> None:
    first, second = key(1), key(2)
    reserved = l1.reserve_write(
        [first, second, first], [ALIGN, ALIGN, 2 * ALIGN], layouts=["uint8[4096]", "", "uint8[8192]"]
    )
    assert list(reserved) == [first, second]
    assert reserved[first].size == ALIGN and reserved[first].layout == "uint8[4096]"
    assert l1.used_bytes == 2 * ALIGN


def test_stored_keys_and_other_writers_reservations_are_skipped(l1: L1Manager) -> None:
    stored, writing, fresh = key(1), key(2), key(3)
    l1.reserve_write([stored], [ALIGN])
    assert l1.finish_write([stored]) == [True]
    other = l1.reserve_write([writing], [ALIGN])[writing]
    reserved = l1.reserve_write([stored, writing, fresh], [ALIGN] * 3)
    assert list(reserved) == [fresh]
    assert other.skipped_writes == 1, "the skipped writer counts on the other reservation"
    assert l1.get(writing) is other


def test_layouts_stay_with_their_keys_when_some_keys_are_skipped(l1: L1Manager) -> None:
    stored, first, second = key(1), key(2), key(3)
    l1.reserve_write([stored], [ALIGN])
    assert l1.finish_write([stored]) == [True]
    reserved = l1.reserve_write(
        [stored, first, first, second],
        [ALIGN, ALIGN, ALIGN, 100],
        layouts=["uint8[4096]", "int8[4096]", "uint8[4096]", ""],
    )
    assert {name: obj.layout for name, obj in reserved.items()} == {first: "int8[4096]", second: ""}
    assert reserved[second].extent_bytes == ALIGN


def test_a_commit_of_reservations_all_still_in_l1_makes_each_ready_in_order(l1: L1Manager) -> None:
    batch = [key(index) for index in range(8)]
    reserved = l1.reserve_write(batch, [ALIGN] * 8)
    assert l1.finish_reserved(reserved) == list(reserved.values())
    assert all(obj.state is ObjectState.READY for obj in reserved.values())
    assert l1.stats().write_locked == 0
    assert l1.finish_reserved(reserved) == [], "a reservation is committed once"


def test_a_commit_with_a_reaped_and_a_finished_reservation_makes_only_the_others_ready(
    l1: L1Manager,
) -> None:
    """The commit whose reservations are not all still in L1 is the one the C loops must
    not wave through: a reaped reservation now another writer's, and one committed
    before, are left alone while the rest is made ready, in order."""
    first, reaped, done, last = key(1), key(2), key(3), key(4)
    reserved = l1.reserve_write([first, reaped, done, last], [ALIGN] * 4)
    l1.abort_write([reaped])  # as the write TTL's reaping: the key is free for another writer
    other = l1.reserve_write([reaped], [2 * ALIGN])[reaped]
    assert l1.finish_write([done]) == [True]
    assert l1.finish_reserved(reserved) == [reserved[first], reserved[last]]
    assert other.state is ObjectState.WRITING and l1.get(reaped) is other
    assert l1.stats().write_locked == 1
