"""An object locked again within the grid cell it was last locked and released in is not
filed under that cell again.

A lookup files each object taking read locks under its deadline's cell for the reap
(``l1/deadlines.py``), and a release takes nothing out: an engine that looks up a prompt,
releases it and looks it up again within a grid step finds its objects filed there
already.  Their locks must still end at their deadline, and a lock of a later cell must
be filed under that cell.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
from l1_grid_clock import grid_clock

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l1 import reads as reads_module
from lmcache_tiers.l1 import writes as writes_module
from lmcache_tiers.l1.deadlines import LockDeadlines

ALIGN = 4096
LOCK_TTL = 64.0  # a grid step of exactly one second
STEP = LOCK_TTL / reads_module.LOCK_GRID_STEPS
ALL = [ObjectKey("test-relock-in-cell", 0, index.to_bytes(8, "big")) for index in range(4)]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    return grid_clock(monkeypatch, STEP, reads_module, writes_module)


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(
        8 * len(ALL) * ALIGN, align=ALIGN, lock_ttl_s=LOCK_TTL, write_ttl_s=LOCK_TTL, prefault=False
    )
    assert all(manager.finish_write(list(manager.reserve_write(ALL, [ALIGN] * len(ALL)))))
    yield manager
    manager.close()


@pytest.fixture
def filings(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The deadlines lookups filed objects under, one entry per filing pass."""
    seen: list[float] = []
    reading = LockDeadlines.reading

    def counted(self: LockDeadlines, deadline: float) -> set[object]:
        seen.append(deadline)
        return reading(self, deadline)  # type: ignore[return-value]

    monkeypatch.setattr(LockDeadlines, "reading", counted)
    return seen


def test_a_prompt_looked_up_again_after_its_release_in_the_same_cell_is_filed_once(
    l1: L1Manager, clock: list[float], filings: list[float]
) -> None:
    start = clock[0]
    clock[0] = start - 0.5 * STEP
    assert len(l1.reserve_read_prefix(ALL)) == len(ALL)
    l1.finish_read(ALL)
    clock[0] = start  # the same cell
    assert len(l1.reserve_read_prefix(ALL)) == len(ALL)
    l1.finish_read(ALL[:2])
    assert len(l1.reserve_read_prefix(ALL[:3])) == 3  # two released, one still locked
    assert filings == [start + LOCK_TTL]


def test_locks_taken_again_in_the_cell_end_at_its_deadline(l1: L1Manager, clock: list[float]) -> None:
    start = clock[0]
    clock[0] = start - 0.5 * STEP
    l1.reserve_read_prefix(ALL)
    l1.finish_read(ALL)
    clock[0] = start
    l1.reserve_read_prefix(ALL)
    edge = start + LOCK_TTL
    assert l1.expire_locks(math.nextafter(edge, -math.inf)) == 0
    assert l1.expire_locks(edge) == len(ALL)
    assert l1.stats().read_locks == 0
    assert l1._table.locked_extent_bytes == 0
    assert not l1._table.locked


def test_locks_taken_again_in_a_later_cell_are_filed_there_and_end_at_its_deadline(
    l1: L1Manager, clock: list[float], filings: list[float]
) -> None:
    start = clock[0]
    clock[0] = start - 0.5 * STEP
    l1.reserve_read_prefix(ALL)
    l1.finish_read(ALL)
    clock[0] = start + 0.5 * STEP  # the next cell
    l1.reserve_read_prefix(ALL)
    later = start + STEP + LOCK_TTL
    assert filings == [start + LOCK_TTL, later]
    assert l1.expire_locks(start + LOCK_TTL) == 0  # the first cell's end: nothing of it is held
    assert l1.expire_locks(math.nextafter(later, -math.inf)) == 0
    assert l1.expire_locks(later) == len(ALL)
    assert not l1._table.locked


def test_locks_taken_again_after_a_reap_past_the_clock_emptied_their_cell_end_at_its_deadline(
    l1: L1Manager, clock: list[float], filings: list[float]
) -> None:
    """A reap given a time ahead of the clock (``expire_locks(inf)``) empties cells that
    have not ended: an object locked again in such a cell is filed again, or its lock would
    never be reaped."""
    start = clock[0]
    clock[0] = start - 0.5 * STEP
    l1.reserve_read_prefix(ALL)
    assert l1.expire_locks(math.inf) == len(ALL)
    l1.reserve_read_prefix(ALL)  # the same cell, emptied
    assert filings == [start + LOCK_TTL] * 2
    assert l1.expire_locks(start + LOCK_TTL) == len(ALL)
    assert not l1._table.locked
