"""A lookup of a new prompt hashes as little as it can.

Every key of a request is decoded afresh, so its hash (every field of it) is computed on
first use: most of what a lookup that finds nothing costs.  L1 stops at a first key it does
not hold, and counting the distinct keys of the lookup compares their chunk hashes first."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lmcache_tiers.controllers.prefetch_requests import unique_length
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager

ALIGN = 4096
hashed: list[ObjectKey] = []


class CountedKey(ObjectKey):
    """An ObjectKey that notes each time it is hashed."""

    def __hash__(self) -> int:
        hashed.append(self)
        return super().__hash__()


def counted_keys(count: int, model: str = "model") -> list[ObjectKey]:
    return [CountedKey(model, 0, index.to_bytes(4, "big") * 4) for index in range(count)]


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(64 * ALIGN, align=ALIGN, lock_ttl_s=30.0, prefault=False)
    yield manager
    manager.close()


def test_a_lookup_missing_its_first_key_hashes_no_other(l1: L1Manager) -> None:
    stored = [ObjectKey("model", 0, bytes([index]) * 16) for index in range(4)]
    assert all(l1.finish_write(list(l1.reserve_write(stored, [ALIGN] * 4))))
    wanted = counted_keys(64)
    hashed.clear()

    assert l1.reserve_read_prefix(wanted, until_repeat=True) == []
    assert l1.reserve_read_prefix(wanted) == []

    assert set(map(id, hashed)) == {id(wanted[0])}
    assert l1.stats().read_locks == 0


def test_a_lookup_hitting_its_first_key_still_locks_its_prefix(l1: L1Manager) -> None:
    stored = counted_keys(4)
    assert all(l1.finish_write(list(l1.reserve_write(stored, [ALIGN] * 4))))
    wanted = [*counted_keys(3), ObjectKey("other", 0, b"x" * 16), stored[3]]

    assert [obj.key for obj in l1.reserve_read_prefix(wanted, until_repeat=True)] == stored[:3]
    l1.finish_read(stored[:3])


def test_counting_the_distinct_keys_of_a_miss_hashes_no_key() -> None:
    keys = counted_keys(64)
    hashed.clear()

    assert unique_length(keys, 0) == 64
    assert hashed == []


def test_keys_sharing_chunk_hashes_are_still_told_apart_by_their_other_fields() -> None:
    mine, theirs = counted_keys(3), counted_keys(3, model="other")

    assert unique_length([*mine, *theirs], 0) == 6
    assert unique_length([*mine, *theirs, mine[1], theirs[0]], 0) == 6
    assert unique_length([mine[0], theirs[0], CountedKey("model", 0, mine[0].chunk_hash)], 1) == 2
