"""Readers' locks that waited for an L2 store are reaped at their deadline, whatever the
order reaps come in.

A reap empties every read cell that ended by its time (``l1/deadlines.py``), and an object
an L2 store is reading is taken out of them all and stalled until the store reports.  When
a reap with an earlier time then looks at it (a reaper that read the clock earlier but took
the L1 lock later, or a reap given a time past the clock, ``expire_locks(inf)``), the locks
it leaves were filed only under cells already emptied: unless filed again, they were never
reaped and kept their object locked -- out of eviction's reach -- for good.
"""

from __future__ import annotations

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l1 import reads as reads_module
from lmcache_tiers.l1 import removal as removal_module
from lmcache_tiers.l1 import table as table_module
from lmcache_tiers.l1 import writes as writes_module

ALIGN = 512
TTL = 64.0
KEY = ObjectKey("stalled-refiled", 0, b"one")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1024.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    for module in (reads_module, removal_module, table_module, writes_module):
        monkeypatch.setattr(module, "time", fake)
    return fake


def locked_twice_behind_a_store(l1: L1Manager, clock: FakeClock) -> tuple[float, float]:
    """``KEY`` read-locked at two deadlines, stalled by a reap past both while an L2 store
    read it, then the store reported; returns the two deadlines."""
    l1.reserve_write([KEY], [ALIGN])
    l1.finish_write_and_reserve_read([KEY])
    clock.now += TTL / 2
    l1.reserve_read([KEY])
    obj = l1.get(KEY)
    assert obj is not None and obj.lock_groups is not None
    first, later = obj.lock_groups[0], obj.lock_groups[2]
    stored = list(l1.reserve_store([KEY]).values())
    assert l1.expire_locks(later) == 0  # both cells emptied, the object stalled
    l1.finish_store(stored)
    return first, later


def test_locks_left_by_an_earlier_reap_of_a_stalled_object_are_reaped_at_their_deadline(
    clock: FakeClock,
) -> None:
    with L1Manager(16 * ALIGN, align=ALIGN, lock_ttl_s=TTL, write_ttl_s=TTL, prefault=False) as l1:
        first, later = locked_twice_behind_a_store(l1, clock)
        assert l1.expire_locks(first) == 1  # the first lock only
        obj = l1.get(KEY)
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
