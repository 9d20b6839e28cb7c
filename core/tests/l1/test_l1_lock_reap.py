"""The TTL reap looks at what expired, not at every locked object (``l1/deadlines.py``).

It runs under the L1 lock every fraction of a second: a walk of every locked object held
every store and lookup up for ~70 ms per pass with 100k read-locked objects.  Here many
locks are live and a few expired: the reap must reap exactly those, iterate nothing out
of the locked index, and look at no read-locked object filed under a later deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object
from lmcache_tiers.l1 import reads as reads_module
from lmcache_tiers.l1 import removal as removal_module
from lmcache_tiers.l1 import table as table_module
from lmcache_tiers.l1 import writes as writes_module

ALIGN = 512
TTL = 64.0
LIVE = 400
EXPIRED = 3


def keys(start: int, count: int) -> list[ObjectKey]:
    return [ObjectKey("reap", 0, index.to_bytes(8, "big")) for index in range(start, start + count)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class CountingIndex(dict[ObjectKey, L1Object]):
    """The locked index, counting the entries anything iterates out of it."""

    iterated = 0

    def __iter__(self) -> Iterator[ObjectKey]:
        for key in super().__iter__():
            CountingIndex.iterated += 1
            yield key

    def items(self) -> Any:
        CountingIndex.iterated += len(self)
        return super().items()

    def values(self) -> Any:
        CountingIndex.iterated += len(self)
        return super().values()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    for module in (reads_module, removal_module, table_module, writes_module):
        monkeypatch.setattr(module, "time", fake)
    return fake


@pytest.fixture
def looked_at(monkeypatch: pytest.MonkeyPatch) -> list[L1Object]:
    """The read-locked objects whose locks the reap looked at."""
    seen: list[L1Object] = []
    reap = removal_module.reap_read_locks

    def counted(obj: L1Object, now: float) -> int:
        seen.append(obj)
        return reap(obj, now)

    monkeypatch.setattr(removal_module, "reap_read_locks", counted)
    return seen


@pytest.mark.parametrize("kind", ["read", "write"])
def test_a_reap_looks_only_at_the_locks_that_expired(
    clock: FakeClock, looked_at: list[L1Object], kind: str
) -> None:
    old, new = keys(0, EXPIRED), keys(EXPIRED, LIVE)
    with L1Manager(
        2 * (LIVE + EXPIRED) * ALIGN, align=ALIGN, lock_ttl_s=TTL, write_ttl_s=TTL, prefault=False
    ) as l1:
        l1.reserve_write(old, [ALIGN] * EXPIRED)
        if kind == "read":
            l1.finish_write_and_reserve_read(old)
        clock.now += TTL / 2  # the later locks expire half a TTL after the first ones
        l1.reserve_write(new, [ALIGN] * LIVE)
        if kind == "read":
            l1.finish_write_and_reserve_read(new)
        first = l1.get(old[0])
        assert first is not None
        table = l1._table
        table.locked = CountingIndex(table.locked)  # type: ignore[assignment]
        CountingIndex.iterated = 0

        assert l1.expire_locks(first.lock_deadline) == EXPIRED

        assert CountingIndex.iterated == 0, "the reap walked the locked index"
        assert len(looked_at) == (EXPIRED if kind == "read" else 0), "the reap looked at live locks"
        if kind == "read":
            assert all(l1.get(each).read_locks == 0 for each in old)  # type: ignore[union-attr]
        else:
            assert not any(l1.contains(each) for each in old)
        assert all(l1.get(each).locked for each in new)  # type: ignore[union-attr]
        assert l1.expire_locks(first.lock_deadline + TTL) == LIVE
        assert not table.locked


def test_locks_released_since_they_were_filed_are_passed_over(clock: FakeClock) -> None:
    # A release leaves its object filed under the deadline (the lookup path stays a count):
    # when that cell ends, the object unlocked, or locked again later, loses nothing.
    with L1Manager(16 * ALIGN, align=ALIGN, lock_ttl_s=TTL, write_ttl_s=TTL, prefault=False) as l1:
        both = keys(0, 2)
        l1.reserve_write(both, [ALIGN] * 2)
        l1.finish_write_and_reserve_read(both)
        deadline = l1.get(both[0]).lock_deadline  # type: ignore[union-attr]
        l1.finish_read(both)
        clock.now += TTL / 2
        l1.reserve_read(both[1:])  # locked again, at a later deadline
        assert l1.expire_locks(deadline) == 0
        assert l1.get(both[1]).read_locks == 1  # type: ignore[union-attr]
        assert l1.expire_locks(deadline + TTL) == 1
        assert not l1._table.locked


def test_reader_locks_behind_an_l2_store_are_reaped_once_it_reports(clock: FakeClock) -> None:
    # A store's lock is never reaped, and the readers' locks of its object wait for it: a
    # cell that ended meanwhile must not forget them.
    with L1Manager(16 * ALIGN, align=ALIGN, lock_ttl_s=TTL, write_ttl_s=TTL, prefault=False) as l1:
        (one,) = keys(0, 1)
        l1.reserve_write([one], [ALIGN])
        l1.finish_write_and_reserve_read([one])
        deadline = l1.get(one).lock_deadline  # type: ignore[union-attr]
        stored = list(l1.reserve_store([one]).values())
        assert l1.expire_locks(deadline) == 0
        assert l1.get(one).read_locks == 2  # type: ignore[union-attr]
        l1.finish_store(stored)
        assert l1.get(one).read_locks == 1  # type: ignore[union-attr]
        assert l1.expire_locks(deadline) == 1
        assert not l1._table.locked


STALLED_KEY = ObjectKey("stalled-refiled", 0, b"one")


# Readers' locks that waited for an L2 store are reaped at their deadline whatever the order
# reaps come in.  A reap empties every read cell that ended by its time and stalls an object
# an L2 store is reading; when a reap with an earlier time then looks at it (a reaper that
# read the clock earlier but took the L1 lock later, or any reap after one given a time past
# the clock), the locks it leaves were filed only under cells already emptied: unless filed
# again, they were never reaped and kept their object out of eviction's reach for good.


def locked_twice_behind_a_store(l1: L1Manager, clock: FakeClock) -> tuple[float, float]:
    """``STALLED_KEY`` read-locked at two deadlines, stalled by a reap past both while an L2 store
    read it, then the store reported; returns the two deadlines."""
    l1.reserve_write([STALLED_KEY], [ALIGN])
    l1.finish_write_and_reserve_read([STALLED_KEY])
    clock.now += TTL / 2
    l1.reserve_read([STALLED_KEY])
    obj = l1.get(STALLED_KEY)
    assert obj is not None and obj.lock_groups is not None
    first, later = obj.lock_groups[0], obj.lock_groups[2]
    stored = list(l1.reserve_store([STALLED_KEY]).values())
    assert l1.expire_locks(later) == 0  # both cells emptied, the object stalled
    l1.finish_store(stored)
    return first, later


def test_locks_left_by_an_earlier_reap_of_a_stalled_object_are_reaped_at_their_deadline(
    clock: FakeClock,
) -> None:
    with L1Manager(16 * ALIGN, align=ALIGN, lock_ttl_s=TTL, write_ttl_s=TTL, prefault=False) as l1:
        first, later = locked_twice_behind_a_store(l1, clock)
        assert l1.expire_locks(first) == 1  # the first lock only
        obj = l1.get(STALLED_KEY)
        assert obj is not None and obj.read_locks == 1
        assert l1.expire_locks(later) == 1
        assert not obj.read_locks and not l1._table.locked
        assert l1._table.locked_extent_bytes == 0


def test_a_stalled_object_looked_at_before_any_of_its_deadlines_is_reaped_at_them(
    clock: FakeClock,
) -> None:
    with L1Manager(16 * ALIGN, align=ALIGN, lock_ttl_s=TTL, write_ttl_s=TTL, prefault=False) as l1:
        first, later = locked_twice_behind_a_store(l1, clock)
        assert l1.expire_locks(first - 1) == 0  # nothing due yet
        assert l1.expire_locks(later) == 1
        assert not l1._table.locked
        assert l1._table.locked_extent_bytes == 0


class CountingGraces(dict[int, float]):
    """The grace periods of expired locks, counting the entries anything walks."""

    walked = 0

    def items(self) -> Any:
        for item in super().items():
            CountingGraces.walked += 1
            yield item


def test_a_reap_after_many_locks_expired_walks_only_the_grace_periods_over(clock: FakeClock) -> None:
    # A crashed client's locks all expire at once; their extents are held back for the
    # grace period if they leave L1 meanwhile.  Every reap pass of that period rebuilt the
    # whole record of them (~18 ms with 100k); only the periods over are to go.
    with L1Manager(
        2 * LIVE * ALIGN, align=ALIGN, lock_ttl_s=TTL, write_ttl_s=TTL, lease_grace_s=10.0, prefault=False
    ) as l1:
        many = keys(0, LIVE)
        l1.reserve_write(many, [ALIGN] * LIVE)
        l1.finish_write_and_reserve_read(many)
        deadline = l1.get(many[0]).lock_deadline  # type: ignore[union-attr]
        assert l1.expire_locks(deadline) == LIVE
        leases = l1._leases
        leases._lapsed = CountingGraces(leases._lapsed)
        CountingGraces.walked = 0
        assert l1.expire_locks(deadline + 1.0) == 0
        assert CountingGraces.walked <= 1, "the reap walked grace periods not over"
        assert l1.lease_stats().lapsed_objects == LIVE
        assert l1.expire_locks(deadline + 10.0) == 0
        assert l1.lease_stats().lapsed_objects == 0
