"""ReadLocks.lock_deadline: the deadline a lookup files its read locks under is exactly
``read_lock_deadline`` of its time, though rounded afresh only once per grid cell."""

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


@pytest.mark.parametrize("where", [0.1, 0.5, 0.9, 0.999])
def test_a_lookup_anywhere_in_a_cell_spares_the_later_ones_of_that_cell_the_rounding(
    read_locks: Callable[[float], ReadLocks], monkeypatch: pytest.MonkeyPatch, where: float
) -> None:
    """The span a rounding is kept for reaches to its cell's end, not only to its middle:
    a lookup in the second half of a cell used to round afresh on every call until the
    next cell began, half the time of a busy server."""
    import lmcache_tiers.l1.reads as reads

    ttl = 64.0
    step = ttl / LOCK_GRID_STEPS
    locks = read_locks(ttl)
    rounded: list[float] = []

    def counted(now: float, lock_ttl_s: float) -> float:
        rounded.append(now)
        return read_lock_deadline(now, lock_ttl_s)

    monkeypatch.setattr(reads, "read_lock_deadline", counted)
    cell_start = 1000 * step
    first = cell_start + where * step
    deadline = locks.lock_deadline(first)
    rounded.clear()
    later = first + (1 - where) * step * 0.9
    assert locks.lock_deadline(later) == deadline == read_lock_deadline(later, ttl)
    assert rounded == [], "a later lookup of the same cell rounded afresh"


def test_the_front_ends_deadline_comes_from_the_span_too(
    read_locks: Callable[[float], ReadLocks], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``L1Manager.lock_deadline`` (what a front end asks on every LOOKUP it answers, for
    the locks it records for the client) is the same float, from the span the lookups keep:
    one rounding per cell for both, not one more per LOOKUP."""
    import lmcache_tiers.l1.reads as reads

    ttl = 64.0
    step = ttl / LOCK_GRID_STEPS
    l1 = L1Manager(4 * ALIGN, align=ALIGN, prefault=False, lock_ttl_s=ttl)
    try:
        rounded: list[float] = []

        def counted(now: float, lock_ttl_s: float) -> float:
            rounded.append(now)
            return read_lock_deadline(now, lock_ttl_s)

        monkeypatch.setattr(reads, "read_lock_deadline", counted)
        first = 1000 * step + 0.1 * step
        deadline = l1.lock_deadline(first)
        assert deadline == read_lock_deadline(first, ttl)
        rounded.clear()
        for index in range(1, 50):
            now = first + index * step / 100
            assert l1.lock_deadline(now) == deadline == read_lock_deadline(now, ttl)
            assert l1._reads.lock_deadline(now) == deadline
        assert rounded == [], "the front end's deadline was rounded afresh within the span"
        # Out of order and past the cell: still the very deadline of each time.
        for now in (first - step, first + 3 * step, first + 0.5 * step, 1e6):
            assert l1.lock_deadline(now) == read_lock_deadline(now, ttl), now
    finally:
        l1.close()
