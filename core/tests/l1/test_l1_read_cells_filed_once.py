"""A lookup whose objects all hold locks of its deadline files none of them again.

Every object that takes read locks is filed under their deadline's cell for the reap
(``l1/deadlines.py``) and stays there until the cell ends; a lookup of a new key list whose
objects were all locked within this grid step already (a hot prefix, new prompts sharing
it) skips that pass, and so does one locking objects locked and released within this
step (a release takes nothing out: an engine looking a prompt up again after releasing
it).  Their locks must still end at their deadline, and a reap given a time past the clock,
which empties cells before they end, makes the next lookup file its objects again.
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
ALL = [ObjectKey("test-filed-once", 0, index.to_bytes(8, "big")) for index in range(6)]
FOUR = ALL[:4]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The clock read locks and write reservations take their deadlines from, at the end
    of a grid cell (``grid_clock``)."""
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


def test_a_new_list_of_objects_locked_in_this_cell_files_nothing(
    l1: L1Manager, clock: list[float], filings: list[float]
) -> None:
    start = clock[0]
    clock[0] = start - 0.5 * STEP
    l1.reserve_read_prefix(ALL[:4])
    assert len(filings) == 1
    clock[0] = start  # the same cell
    l1.reserve_read_prefix(ALL[1:4])  # a new list, every object locked in this cell already
    l1.reserve_read_prefix(ALL[:3])
    assert len(filings) == 1
    l1.reserve_read_prefix(ALL[2:6])  # two objects not locked yet: filed
    assert len(filings) == 2
    clock[0] = start + 0.5 * STEP  # the next cell: its own deadline, filed
    l1.reserve_read_prefix(ALL[1:3])
    assert filings == [start + LOCK_TTL] * 2 + [start + STEP + LOCK_TTL]


def test_locks_of_lookups_that_filed_nothing_end_at_their_deadline(l1: L1Manager, clock: list[float]) -> None:
    start = clock[0]
    clock[0] = start - 0.5 * STEP
    l1.reserve_read_prefix(ALL[:4])
    clock[0] = start  # the same cell
    l1.reserve_read_prefix(ALL[1:4])
    l1.reserve_read_prefix(ALL[:2])
    objects = [l1.get(key) for key in ALL[:4]]
    assert [obj.read_locks for obj in objects if obj is not None] == [2, 3, 2, 2]
    edge = start + LOCK_TTL
    assert l1.expire_locks(math.nextafter(edge, -math.inf)) == 0
    assert l1.expire_locks(edge) == 4  # every lock of every object, none left behind
    assert not any(obj is not None and obj.read_locks for obj in objects)
    assert l1._table.locked_extent_bytes == 0
    assert not l1._table.locked


def test_a_lock_joining_a_write_deadline_on_the_grid_is_reaped(l1: L1Manager, clock: list[float]) -> None:
    """A committed object keeps no write deadline as its lock deadline: one on the grid
    (a write TTL of the lock TTL, from a time on the grid) would read as a lock of this
    cell already filed, and a reader's lock joining an L2 store's would never be reaped."""
    start = clock[0]
    key = ObjectKey("test-filed-once", 0, b"on-grid")
    assert all(l1.finish_write(list(l1.reserve_write([key], [ALIGN]))))  # its write deadline: start + TTL
    stored = l1.reserve_store([key])
    l1.reserve_read_prefix([key])  # the same deadline, start + TTL
    l1.finish_store(stored.values())
    obj = l1.get(key)
    assert obj is not None and obj.read_locks == 1
    assert l1.expire_locks(start + LOCK_TTL) == 1
    assert not obj.read_locks and key not in l1._table.locked


def test_a_prompt_looked_up_again_after_its_release_in_the_same_cell_is_filed_once(
    l1: L1Manager, clock: list[float], filings: list[float]
) -> None:
    start = clock[0]
    clock[0] = start - 0.5 * STEP
    assert len(l1.reserve_read_prefix(FOUR)) == len(FOUR)
    l1.finish_read(FOUR)
    clock[0] = start  # the same cell
    assert len(l1.reserve_read_prefix(FOUR)) == len(FOUR)
    l1.finish_read(FOUR[:2])
    assert len(l1.reserve_read_prefix(FOUR[:3])) == 3  # two released, one still locked
    assert filings == [start + LOCK_TTL]


def test_locks_taken_again_in_the_cell_end_at_its_deadline(l1: L1Manager, clock: list[float]) -> None:
    start = clock[0]
    clock[0] = start - 0.5 * STEP
    l1.reserve_read_prefix(FOUR)
    l1.finish_read(FOUR)
    clock[0] = start
    l1.reserve_read_prefix(FOUR)
    edge = start + LOCK_TTL
    assert l1.expire_locks(math.nextafter(edge, -math.inf)) == 0
    assert l1.expire_locks(edge) == len(FOUR)
    assert l1.stats().read_locks == 0
    assert l1._table.locked_extent_bytes == 0
    assert not l1._table.locked


def test_locks_taken_again_in_a_later_cell_are_filed_there_and_end_at_its_deadline(
    l1: L1Manager, clock: list[float], filings: list[float]
) -> None:
    start = clock[0]
    clock[0] = start - 0.5 * STEP
    l1.reserve_read_prefix(FOUR)
    l1.finish_read(FOUR)
    clock[0] = start + 0.5 * STEP  # the next cell
    l1.reserve_read_prefix(FOUR)
    later = start + STEP + LOCK_TTL
    assert filings == [start + LOCK_TTL, later]
    assert l1.expire_locks(start + LOCK_TTL) == 0  # the first cell's end: nothing of it is held
    assert l1.expire_locks(math.nextafter(later, -math.inf)) == 0
    assert l1.expire_locks(later) == len(FOUR)
    assert not l1._table.locked


def test_locks_taken_again_after_a_reap_past_the_clock_emptied_their_cell_end_at_its_deadline(
    l1: L1Manager, clock: list[float], filings: list[float]
) -> None:
    """A reap given a time ahead of the clock (``expire_locks(inf)``) empties cells that
    have not ended: an object locked again in such a cell is filed again, or its lock would
    never be reaped."""
    start = clock[0]
    clock[0] = start - 0.5 * STEP
    l1.reserve_read_prefix(FOUR)
    assert l1.expire_locks(math.inf) == len(FOUR)
    l1.reserve_read_prefix(FOUR)  # the same cell, emptied
    assert filings == [start + LOCK_TTL] * 2
    assert l1.expire_locks(start + LOCK_TTL) == len(FOUR)
    assert not l1._table.locked
