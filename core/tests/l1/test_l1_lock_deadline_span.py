"""ReadLocks.lock_deadline: the deadline a lookup files its read locks under is exactly
``read_lock_deadline`` of its time, though rounded afresh only once per half grid step."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest

from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l1.reads import LOCK_GRID_STEPS, ReadLocks, read_lock_deadline

ALIGN = 4096


@pytest.fixture
def read_locks() -> Iterator[Callable[[float], ReadLocks]]:
    built: list[L1Manager] = []

    def build(ttl: float) -> ReadLocks:
        l1 = L1Manager(4 * ALIGN, align=ALIGN, prefault=False, lock_ttl_s=ttl)
        built.append(l1)
        return l1._reads

    yield build
    for l1 in built:
        l1.close()


@pytest.mark.parametrize("ttl", [300.0, 30.0, 1.0, 0.001, 1e-7, 7.3, math.inf])
@pytest.mark.parametrize("start", [0.0, 12_345.678, 3.1e6])
def test_every_time_gets_the_deadline_rounded_afresh(
    read_locks: Callable[[float], ReadLocks], ttl: float, start: float
) -> None:
    locks = read_locks(ttl)
    step = ttl / LOCK_GRID_STEPS if math.isfinite(ttl) else 1.0
    # Times close together (many within a grid step), times right at the cells' edges and
    # a ulp either side of them, and a jump far ahead: as a clock read under the lock.
    times = [start + step * index / 7 for index in range(200)]
    edges = (
        [
            cell * step - ttl
            for cell in range(math.ceil((start + ttl) / step), math.ceil((start + ttl) / step) + 5)
        ]
        if math.isfinite(ttl)
        else []
    )
    for edge in edges:
        times += [math.nextafter(edge, -math.inf), edge, math.nextafter(edge, math.inf)]
    times += [start + 1e5 * step]
    for now in sorted(time for time in times if time >= start):
        assert locks.lock_deadline(now) == read_lock_deadline(now, ttl), (now, ttl)


def test_a_clock_read_late_for_the_lock_still_gets_its_own_deadline(
    read_locks: Callable[[float], ReadLocks],
) -> None:
    """Threads read the clock before waiting for the L1 lock: times come in out of order."""
    locks = read_locks(64.0)
    for now in (100.2, 100.9, 100.1, 99.0, 101.0, 100.5, 98.99, 1e6, 100.3):
        assert locks.lock_deadline(now) == read_lock_deadline(now, 64.0), now
