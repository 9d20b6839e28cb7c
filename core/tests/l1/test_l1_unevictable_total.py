"""The bytes no eviction frees are a running total, exact after every call, and asking for
them costs the same however many objects are locked.

Every write that finds L1 full asks ``reclaimable_bytes``: a busy server's L1 is full, and
its clients hold read locks from their lookups on thousands of objects.  A walk of the
locked objects per such write cost milliseconds with 10k of them, tens with 100k.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from unittest import mock

import pytest

from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object, ObjectState
from lmcache_tiers.l1 import manager as manager_module

ALIGN = 4096
UNITS = 48
KEYS = [ObjectKey("model", 0, index.to_bytes(2, "big")) for index in range(24)]


def in_grace_period(l1: L1Manager, now: float) -> list[L1Object]:
    """Unlocked READY objects whose expired locks' grace period has not ended at ``now``:
    evicting one holds its extent back, so no eviction frees it now."""
    lapsed = l1._leases._lapsed
    return [
        obj
        for obj in l1._table.objects.values()
        if obj.state is ObjectState.READY and not obj.read_locks and lapsed.get(obj.offset, 0.0) > now
    ]


def walked_unevictable_bytes(l1: L1Manager, now: float) -> int:
    """What no eviction frees at ``now``, walked extent by extent: locked objects, extents
    held for loads, quarantined extents, objects in their grace period (each at the
    allocator's length for it)."""
    size_at = l1._allocator.size_at
    objects = sum(size_at(obj.offset) for obj in [*l1._table.unevictable(), *in_grace_period(l1, now)])
    return objects + sum(length for _offset, length in l1._leases.held_extents())


class FrozenClock:
    """The ``time`` module of the L1 manager, stopped at one instant: a grace period
    ending between the manager's reading and the walk's would tell them apart."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now


def check_books(l1: L1Manager, step: str) -> None:
    now = time.monotonic()
    with mock.patch.object(manager_module, "time", FrozenClock(now)):
        assert l1.reclaimable_bytes() == l1.capacity_bytes - walked_unevictable_bytes(l1, now), step
        table = l1._table
        assert table.locked_extent_bytes == sum(obj.extent_bytes for obj in table.locked.values()), step
        assert l1.unevictable_extents() == len(table.unevictable()) + len(l1._leases.held_extents()) + len(
            in_grace_period(l1, now)
        ), step
    if not table.closed:
        for obj in table.objects.values():
            assert obj.extent_bytes == l1._allocator.size_at(obj.offset), step


class RandomCalls:
    """Random calls of every kind that locks, unlocks, holds or frees an object."""

    def __init__(self, l1: L1Manager, rng: random.Random) -> None:
        self.l1 = l1
        self.rng = rng
        self.lock_ttl_s = l1.lock_ttl_s
        self.loads: list[L1Object] = []
        self.stores: list[L1Object] = []

    def keys(self, most: int = 6) -> list[ObjectKey]:
        # repeats on purpose: a key twice in a batch is locked (and released) once per call
        return [self.rng.choice(KEYS) for _ in range(self.rng.randint(0, most))]

    def count(self) -> int:
        return self.rng.choice([1, 1, 2, 3])

    def sizes(self, keys: list[ObjectKey]) -> list[int]:
        # unaligned sizes and 0-byte objects too: an extent is the size rounded up, one unit at least
        return [self.rng.choice([0, 1, ALIGN - 1, ALIGN, 2 * ALIGN + 7, 5 * ALIGN]) for _ in keys]

    def reserve_write(self) -> None:
        keys = self.keys()
        try:
            self.l1.reserve_write(keys, self.sizes(keys), temporary=self.rng.random() < 0.3)
        except L1OutOfMemoryError:
            pass

    def finish_write(self) -> None:
        if self.rng.random() < 0.5:
            self.l1.finish_write(self.keys())
        else:
            self.l1.finish_write_and_reserve_read(self.keys(), self.count())

    def abort_write(self) -> None:
        self.l1.abort_write(self.keys())

    def reserve_read(self) -> None:
        if self.rng.random() < 0.5:
            self.l1.reserve_read(self.keys(), self.count())
        else:
            self.l1.reserve_read_prefix(self.keys(), self.count(), until_repeat=self.rng.random() < 0.5)

    def reserve_read_same(self) -> None:
        # the very keys again: a lookup repeated finds its remembered prefix
        keys = KEYS[:4]
        self.l1.reserve_read_prefix(keys, self.count())
        if self.rng.random() < 0.7:
            self.l1.finish_read(keys)

    def finish_read(self) -> None:
        not_before = self.l1.lock_deadline(time.monotonic()) if self.rng.random() < 0.3 else None
        self.l1.finish_read(self.keys(), self.count(), not_before=not_before)

    def reserve_store(self) -> None:
        self.stores.extend(self.l1.reserve_store(self.keys()).values())

    def finish_store(self) -> None:
        if self.stores:
            done = self.rng.randint(1, len(self.stores))
            self.l1.finish_store(self.stores[:done])
            del self.stores[:done]

    def reserve_load(self) -> None:
        keys = self.keys(3)
        try:
            self.loads.extend(self.l1.reserve_load(keys, self.sizes(keys), temporary=False).values())
        except L1OutOfMemoryError:
            pass

    def write_over_loads(self) -> None:
        # a client's write takes over the keys being loaded: their extents are held
        keys = [obj.key for obj in self.loads[:3]]
        try:
            self.l1.reserve_write(keys, self.sizes(keys))
        except L1OutOfMemoryError:
            pass

    def end_loads(self) -> None:
        if not self.loads:
            return
        ended = self.loads[: self.rng.randint(1, len(self.loads))]
        del self.loads[: len(ended)]
        if self.rng.random() < 0.5:
            self.l1.finish_load(ended, self.count())
        self.l1.abort_load(ended)  # the loads that finished are left alone

    def delete(self) -> None:
        self.l1.delete(self.keys(), force=self.rng.random() < 0.4)

    def evict(self) -> None:
        self.l1.make_room(
            self.rng.randint(1, 10) * ALIGN, self.keys(10), spare_unstored=self.rng.random() < 0.5
        )

    def expire(self) -> None:
        # a sweep now, within a lock's TTL, past it, or past every lease
        ttl = self.lock_ttl_s
        ahead = self.rng.choice([0.0, ttl / 2, ttl * 1.5, ttl * 100])
        self.l1.expire_locks(time.monotonic() + ahead)

    def set_temporary(self) -> None:
        self.l1.set_temporary(self.keys(), self.rng.random() < 0.5)

    def clear(self) -> None:
        if self.rng.random() < 0.3:
            self.l1.clear(force=self.rng.random() < 0.5)

    def calls(self) -> list[Callable[[], None]]:
        return [
            self.reserve_write,
            self.reserve_write,
            self.finish_write,
            self.abort_write,
            self.reserve_read,
            self.reserve_read,
            self.reserve_read_same,
            self.finish_read,
            self.finish_read,
            self.reserve_store,
            self.finish_store,
            self.reserve_load,
            self.write_over_loads,
            self.end_loads,
            self.delete,
            self.evict,
            self.expire,
            self.set_temporary,
            self.clear,
        ]


# A long lock TTL, and one so short that locks taken a few calls apart fall in different
# steps of its grid (an object's locks then keep several deadlines) and the clock expires them.
@pytest.mark.parametrize("lock_ttl_s", [4.0, 0.1])
@pytest.mark.parametrize("seed", range(8))
def test_the_running_total_equals_the_walk_after_every_call(seed: int, lock_ttl_s: float) -> None:
    rng = random.Random(seed)
    l1 = L1Manager(UNITS * ALIGN, align=ALIGN, lock_ttl_s=lock_ttl_s, write_ttl_s=lock_ttl_s, prefault=False)
    calls = RandomCalls(l1, rng)
    choices = calls.calls()
    try:
        for step in range(600):
            call = rng.choice(choices)
            call()
            check_books(l1, f"step {step}: {call.__name__}")
        kinds = {obj.state for obj in l1._table.locked.values()}
        assert kinds <= {ObjectState.WRITING, ObjectState.READY}
    finally:
        l1.close()
    # Closed: nothing is locked nor quarantined any more, only the loads' extents stay held.
    check_books(l1, "closed")
    assert l1._table.locked_extent_bytes == 0


def python_calls_during(action: Callable[[], object]) -> int:
    """How many Python and C functions ``action`` calls (generators resumed included):
    work that grows with the data shows here, without a clock."""
    calls = 0

    def count(_frame: object, event: str, _arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        action()
    finally:
        sys.setprofile(None)
    return calls


def locked_l1(locked: int) -> L1Manager:
    """An L1 holding ``locked`` read-locked objects, and a write reservation and a load's
    held extent, the rest of it filled with unlocked ones."""
    l1 = L1Manager((2 * locked + 8) * ALIGN, align=ALIGN, prefault=False)
    keys = [ObjectKey("model", 0, index.to_bytes(4, "big")) for index in range(2 * locked + 8)]
    l1.reserve_write(keys[:-2], [ALIGN] * (len(keys) - 2))
    l1.finish_write(keys[:-3])
    l1.reserve_read(keys[:locked])
    [load] = l1.reserve_load(keys[-2:-1], [ALIGN], temporary=False).values()
    l1.reserve_write([load.key], [ALIGN])  # takes the load over: its extent is held
    return l1


def test_reclaimable_bytes_costs_the_same_however_many_objects_are_locked() -> None:
    few, many = locked_l1(10), locked_l1(2000)
    try:
        assert many.reclaimable_bytes() == many.capacity_bytes - walked_unevictable_bytes(
            many, time.monotonic()
        )
        assert python_calls_during(many.reclaimable_bytes) == python_calls_during(few.reclaimable_bytes)
    finally:
        few.close()
        many.close()
