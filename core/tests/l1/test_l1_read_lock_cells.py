"""Read locks joining the last deadline cell of an object (``l1/reads.py``).

A lock taken within the grid step of an object's latest deadline joins that deadline's
count in place, whether or not the object also holds locks of earlier steps; only a lock
of a new step starts a group.  These tests pin down both sides of that boundary, and that
every lock still expires at its own deadline, exactly at the cell's edge.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
from l1_grid_clock import grid_clock

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object
from lmcache_tiers.l1 import reads as reads_module

ALIGN = 4096
LOCK_TTL = 64.0  # a grid step of exactly one second
STEP = LOCK_TTL / reads_module.LOCK_GRID_STEPS
KEYS = 8


def key(index: int) -> ObjectKey:
    return ObjectKey("test-cells", 0, index.to_bytes(8, "big"))


ALL = [key(index) for index in range(KEYS)]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The clock read locks take their deadlines from, set by the test; it starts at the
    beginning of a grid cell (``grid_clock``)."""
    return grid_clock(monkeypatch, STEP, reads_module)


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(
        4 * KEYS * ALIGN, align=ALIGN, lock_ttl_s=LOCK_TTL, write_ttl_s=LOCK_TTL, prefault=False
    )
    reserved = manager.reserve_write(ALL, [ALIGN] * KEYS)
    assert all(manager.finish_write(list(reserved)))
    yield manager
    manager.close()


@pytest.fixture
def general_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How often the general lock path ran (the real one, counted)."""
    calls: Counter[str] = Counter()
    general = reads_module.add_read_locks

    def counted(obj: L1Object, count: int, deadline: float) -> None:
        calls["add_read_locks"] += 1
        general(obj, count, deadline)

    monkeypatch.setattr(reads_module, "add_read_locks", counted)
    return calls


def objects(l1: L1Manager) -> list[L1Object]:
    found = [l1.get(each) for each in ALL]
    assert all(obj is not None for obj in found)
    return [obj for obj in found if obj is not None]


def deadlines_of(obj: L1Object) -> dict[float, int]:
    """``obj``'s readers' locks per deadline, as its bookkeeping says."""
    readers = obj.read_locks - obj.storing
    if not readers:
        return {}
    if obj.lock_groups is None:
        return {obj.lock_deadline: readers}
    groups = obj.lock_groups
    pairs = dict(zip(groups[::2], map(int, groups[1::2]), strict=True))
    assert list(pairs) == sorted(pairs) and obj.lock_deadline == groups[-2]
    assert sum(pairs.values()) == readers
    return pairs


def check_totals(l1: L1Manager) -> None:
    table = l1._table
    assert table.locked_extent_bytes == sum(obj.extent_bytes for obj in table.locked.values())
    assert all(obj.read_locks for obj in table.locked.values())


LOCKERS: dict[str, Callable[[L1Manager, list[ObjectKey]], object]] = {
    "prefix": lambda l1, wanted: l1.reserve_read_prefix(wanted),
    "present": lambda l1, wanted: l1.reserve_read(wanted),
}


@pytest.mark.parametrize("lock", LOCKERS)
def test_a_lock_in_the_cell_of_the_latest_deadline_joins_it_in_place(
    l1: L1Manager, clock: list[float], general_calls: Counter[str], lock: str
) -> None:
    take = LOCKERS[lock]
    start = clock[0]
    take(l1, ALL)  # cell A
    clock[0] = start + 1.5 * STEP
    take(l1, ALL)  # cell B: a new group per object
    assert general_calls["add_read_locks"] == KEYS
    for repeat in range(3):  # B again, the same keys (remembered) and not
        clock[0] = start + 1.5 * STEP + repeat * STEP / 8
        take(l1, ALL)
        take(l1, ALL[1:])
    # every lock of cell B joined B's group without the general path
    assert general_calls["add_read_locks"] == KEYS
    first, second = start + LOCK_TTL, start + 2 * STEP + LOCK_TTL
    objs = objects(l1)
    assert deadlines_of(objs[0]) == {first: 1, second: 4}
    for obj in objs[1:]:
        assert deadlines_of(obj) == {first: 1, second: 7}
    check_totals(l1)


@pytest.mark.parametrize("lock", LOCKERS)
def test_a_lock_one_cell_later_starts_a_group_of_its_own(
    l1: L1Manager, clock: list[float], general_calls: Counter[str], lock: str
) -> None:
    take = LOCKERS[lock]
    start = clock[0]
    take(l1, ALL)  # deadline start + TTL
    clock[0] = math.nextafter(start, math.inf)  # just past the cell's edge: the next cell
    take(l1, ALL)
    clock[0] = start + STEP  # the end of that cell, which it includes: joins it
    take(l1, ALL)
    assert general_calls["add_read_locks"] == KEYS
    clock[0] = math.nextafter(start + STEP, math.inf)  # the cell after
    take(l1, ALL)
    assert general_calls["add_read_locks"] == 2 * KEYS
    first = start + LOCK_TTL
    for obj in objects(l1):
        assert deadlines_of(obj) == {first: 1, first + STEP: 2, first + 2 * STEP: 1}
    check_totals(l1)


def test_locks_joining_the_last_cell_expire_at_its_edge_and_not_before(
    l1: L1Manager, clock: list[float]
) -> None:
    start = clock[0]
    clock[0] = start - 0.5 * STEP
    l1.reserve_read_prefix(ALL)  # cell A: deadline start + TTL
    clock[0] = start
    l1.reserve_read_prefix(ALL)  # A again
    clock[0] = start + 1.25 * STEP
    l1.reserve_read_prefix(ALL)  # cell B
    clock[0] = start + 1.75 * STEP
    l1.reserve_read_prefix(ALL)  # B again: joins B's group
    l1.reserve_read(ALL)  # and again
    objs = objects(l1)
    edge_a, edge_b = start + LOCK_TTL, start + 2 * STEP + LOCK_TTL
    assert l1.expire_locks(math.nextafter(edge_a, -math.inf)) == 0
    assert all(obj.read_locks == 5 for obj in objs)
    assert l1.expire_locks(edge_a) == KEYS  # A's two locks per object, at A's edge
    assert all(deadlines_of(obj) == {edge_b: 3} for obj in objs)
    check_totals(l1)
    clock[0] = edge_a + 0.5 * STEP
    l1.reserve_read_prefix(ALL)  # a cell after B: a group after B's
    edge_c = edge_a + STEP + LOCK_TTL
    assert all(deadlines_of(obj) == {edge_b: 3, edge_c: 1} for obj in objs)
    clock[0] = edge_a + STEP
    l1.reserve_read(ALL)  # the end of that cell: joins it
    assert all(deadlines_of(obj) == {edge_b: 3, edge_c: 2} for obj in objs)
    assert l1.expire_locks(math.nextafter(edge_b, -math.inf)) == 0
    assert l1.expire_locks(edge_b) == KEYS
    assert all(deadlines_of(obj) == {edge_c: 2} for obj in objs)
    assert l1.expire_locks(math.nextafter(edge_c, -math.inf)) == 0
    assert l1.expire_locks(edge_c) == KEYS
    assert not any(obj.locked for obj in objs)
    check_totals(l1)
    assert l1._table.locked_extent_bytes == 0


def test_random_locks_releases_and_expiries_keep_every_locks_own_deadline(
    l1: L1Manager, clock: list[float]
) -> None:
    # A model keeps each lock's deadline; L1's counts per deadline must match it after every
    # call, whatever mix of cells the locks come from.  Releases say the deadline of the
    # locks they drop (``not_before``), as the front end's do, and drop the earliest such.
    rng = random.Random(20261205)
    start = clock[0]
    model: dict[ObjectKey, list[float]] = {each: [] for each in ALL}
    objs = dict(zip(ALL, objects(l1), strict=True))
    for step in range(3000):
        clock[0] = start + step * STEP / 7
        deadline = reads_module.read_lock_deadline(clock[0], LOCK_TTL)
        action = rng.random()
        if action < 0.5:
            size = rng.randint(1, KEYS)
            wanted = ALL[:size] if rng.random() < 0.7 else rng.sample(ALL, size)
            if rng.random() < 0.5:
                l1.reserve_read_prefix(wanted)
            else:
                l1.reserve_read(wanted)
            for each in wanted:
                model[each].append(deadline)
        elif action < 0.8:
            each = rng.choice(ALL)
            live = sorted(d for d in model[each] if d > clock[0])
            if live:
                l1.finish_read([each], not_before=live[0])
                model[each].remove(live[0])
        else:
            l1.expire_locks(clock[0])
            for each in ALL:
                model[each] = [d for d in model[each] if d > clock[0]]
        for each, obj in objs.items():
            held = [d for d in model[each] if d > clock[0]] if action >= 0.8 else model[each]
            assert deadlines_of(obj) == dict(Counter(sorted(held))), step
        check_totals(l1)
