"""A mass expiry is reaped over several short passes, with the data plane served in between.

One pass reaping 100k expired locks (a client that died holding them, a burst of write
reservations past the write TTL) held the L1 lock for 110-200 ms, and every store, lookup
and retrieve waited as long.  A pass now looks at a bounded number of objects and says
whether more are due (``reap_backlog``).  These tests step the reap with a small budget and
check, between steps, that an object not reaped yet still holds its extent as a locked one
(no reader sees it freed, no writer's extent is given to another object), that the data
plane works, and that the counts of all the passes add up exactly.  The clock is driven
through ``expire_locks(now)``: no sleeps.  The lookups made between steps lock objects too,
filed with the mass and looked at in its passes: a pass may reap fewer than its budget, so
the number of passes is bounded, not exact.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object, ObjectState

ALIGN = 512
MASS = 40
BUDGET = 8
TTL = 30.0
GRACE = 5.0
#: passes a reap of the mass takes at most, with the stores and lookups in between
MOST_STEPS = 2 * MASS // BUDGET
#: room for the mass, its quarantined extents and the stores made between the steps
CAPACITY = 4 * MASS * ALIGN


def keys(group: int, count: int) -> list[ObjectKey]:
    return [ObjectKey("reap-budget", group, index.to_bytes(8, "big")) for index in range(count)]


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(
        CAPACITY, align=ALIGN, lock_ttl_s=TTL, write_ttl_s=TTL, lease_grace_s=GRACE, prefault=False
    )
    yield manager
    manager.close()


def store(l1: L1Manager, group: int, count: int, fill: int) -> list[L1Object]:
    reserved = l1.reserve_write(keys(group, count), [ALIGN] * count)
    for obj in reserved.values():
        l1.write_object(obj, memoryview(bytes([fill]) * ALIGN))
    assert all(l1.finish_write(list(reserved)))
    return list(reserved.values())


def read(l1: L1Manager, obj: L1Object) -> bytes:
    out = bytearray(obj.size)
    l1.read_object(obj, memoryview(out))
    return bytes(out)


def serve_between_steps(l1: L1Manager, step: int, held_offsets: set[int]) -> None:
    """A store and a lookup between two reap passes: they work, and the store is given no
    extent still held by an object the reap has not reached (or has quarantined)."""
    (stored,) = store(l1, 100 + step, 1, fill=0x5A)
    assert stored.offset not in held_offsets
    assert l1.reserve_read([stored.key]) == {stored.key: stored}
    l1.finish_read([stored.key])
    assert l1.delete([stored.key]) == [True]


def reap_in_bounded_passes(l1: L1Manager, due: float, offsets: set[int]) -> Iterator[int]:
    """Reap what is due one budget at a time, yielding after each pass how many were reaped
    so far (the caller checks the state between passes), then serve the data plane before
    the next.  Ends once no backlog is left, having reaped the whole mass in more than one
    pass; a caller that leaves the loop early skips that check."""
    reaped, steps = 0, 0
    while True:
        count = l1.expire_locks(due, budget=BUDGET)
        assert count <= BUDGET
        reaped += count
        steps += 1
        assert steps <= MOST_STEPS
        yield reaped
        serve_between_steps(l1, steps, offsets)
        if not l1.reap_backlog:
            break
    assert reaped == MASS and steps > 1


def test_a_dead_readers_mass_of_expired_locks_is_reaped_over_bounded_passes(l1: L1Manager) -> None:
    objects = store(l1, 1, MASS, fill=0x11)
    l1.reserve_read([obj.key for obj in objects])  # the client that dies holding them
    due = max(obj.lock_deadline for obj in objects)
    offsets = {obj.offset for obj in objects}
    generations = l1.generations(objects)
    for reaped in reap_in_bounded_passes(l1, due, offsets):
        waiting = [obj for obj in objects if obj.read_locks]
        assert len(waiting) == MASS - reaped
        # Not reached yet: still locked, so neither a delete nor an eviction takes it and
        # its bytes stay the reader's; reached: unlocked, its lapse recorded.
        for obj in waiting:
            assert l1.delete([obj.key]) == [False]
            assert read(l1, obj) == bytes([0x11]) * ALIGN
        assert l1.evict(CAPACITY, [obj.key for obj in waiting]) == []
        assert l1.lease_stats().lapsed_objects == reaped
        assert l1.generations(objects) == generations
    assert l1.stats().read_locks == 0
    assert l1.expire_locks(due, budget=BUDGET) == 0 and not l1.reap_backlog


def test_a_burst_of_expired_write_reservations_is_freed_over_bounded_passes(l1: L1Manager) -> None:
    reserved = l1.reserve_write(keys(1, MASS), [ALIGN] * MASS)
    objects = list(reserved.values())
    due = max(obj.lock_deadline for obj in objects)
    offsets = {obj.offset for obj in objects}
    for reaped in reap_in_bounded_passes(l1, due, offsets):
        writing = [obj for obj in objects if l1.get(obj.key) is obj]
        assert len(writing) == MASS - reaped
        assert all(obj.state is ObjectState.WRITING for obj in writing)
        # Every reservation reaped so far is quarantined, none freed: its writer may be
        # only slow.  Those not reached are still their writers' and held by no one else.
        stats = l1.lease_stats()
        assert stats.quarantined_expired == reaped and stats.quarantined_extents == reaped
        assert l1.used_bytes == MASS * ALIGN
    assert l1.stats().write_locked == 0


def test_a_writer_committing_before_the_reap_reaches_it_keeps_its_object(l1: L1Manager) -> None:
    reserved = l1.reserve_write(keys(1, MASS), [ALIGN] * MASS)
    objects = list(reserved.values())
    due = max(obj.lock_deadline for obj in objects)
    assert l1.expire_locks(due, budget=BUDGET) == BUDGET and l1.reap_backlog
    late = objects[-1]  # reserved last: the reap reaches it last
    l1.write_object(late, memoryview(b"\x77" * ALIGN))
    assert l1.finish_write([late.key]) == [True]
    assert l1.finish_write([objects[0].key]) == [False]  # reaped: its write is refused
    reaped = BUDGET
    for _ in range(MOST_STEPS):
        if not l1.reap_backlog:
            break
        reaped += l1.expire_locks(due, budget=BUDGET)
    assert reaped == MASS - 1
    assert l1.get(late.key) is late and read(l1, late) == b"\x77" * ALIGN


def test_leases_ending_at_once_are_reclaimed_over_bounded_passes(l1: L1Manager) -> None:
    objects = store(l1, 1, MASS, fill=0x22)
    l1.reserve_read([obj.key for obj in objects])
    assert l1.clear(force=True) == MASS  # quarantined until their readers let go
    generations = l1.generations(objects)
    lease_end = max(obj.lock_deadline for obj in objects) + GRACE
    held = {obj.offset for obj in objects}
    reclaimed, steps = 0, 0
    while True:
        l1.expire_locks(lease_end, budget=BUDGET)
        steps += 1
        assert steps <= MOST_STEPS
        stats = l1.lease_stats()
        assert stats.reclaimed_lease_end - reclaimed <= BUDGET
        reclaimed = stats.reclaimed_lease_end
        assert stats.quarantined_extents == MASS - reclaimed
        assert l1.used_bytes == (MASS - reclaimed) * ALIGN
        # An extent still held keeps its generation (its readers' copies stay good) and
        # goes to no new object; one given back moved its generation first.
        current = l1.generations(objects)
        unmoved = zip(objects, current, generations, strict=True)
        still_held = {obj.offset for obj, gen, was in unmoved if gen == was}
        assert len(still_held) == MASS - reclaimed
        serve_between_steps(l1, steps, still_held)
        held = still_held
        if not l1.reap_backlog:
            break
    assert reclaimed == MASS and not held and steps > 1


def test_reservations_expiring_pass_after_pass_leave_a_share_to_read_locks(l1: L1Manager) -> None:
    """Writes come first in a pass: a budget's worth of reservations expiring before every
    pass took it all, and a dead reader's expired lock was never looked at."""
    (dead_reader,) = store(l1, 1, 1, fill=0x33)
    l1.reserve_read([dead_reader.key])
    later = dead_reader.lock_deadline + TTL  # every reservation made below is due by then
    reaped = 0
    for step in range(MASS // BUDGET):
        l1.reserve_write(keys(200 + step, BUDGET), [ALIGN] * BUDGET)  # writers that die
        reaped += l1.expire_locks(later, budget=BUDGET)
    assert dead_reader.read_locks == 0 and l1.stats().read_locks == 0
    # Nothing is counted twice or lost: the reservations still due are those left filed.
    while l1.reap_backlog:
        reaped += l1.expire_locks(later, budget=BUDGET)
    assert reaped == 1 + MASS and l1.stats().write_locked == 0


def test_leases_ending_at_once_are_logged_once_not_once_a_pass(
    l1: L1Manager, caplog: pytest.LogCaptureFixture
) -> None:
    """One line for the burst, as when one pass reclaimed them all, with the rest counted
    in it: a mass of 100k leases ending together took some 200 passes, each with its line."""
    objects = store(l1, 1, MASS, fill=0x44)
    l1.reserve_read([obj.key for obj in objects])
    assert l1.clear(force=True) == MASS
    lease_end = max(obj.lock_deadline for obj in objects) + GRACE
    passes = 0
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l1.leases"):
        while True:
            l1.expire_locks(lease_end, budget=BUDGET)
            passes += 1
            if not l1.reap_backlog:
                break
    assert passes > 1 and l1.lease_stats().reclaimed_lease_end == MASS
    lines = [record for record in caplog.records if "end of their lease" in record.getMessage()]
    assert len(lines) == 1, [record.getMessage() for record in lines]


def test_a_stalled_readers_lock_is_reaped_under_reservations_expiring_pass_after_pass(l1: L1Manager) -> None:
    """A dead reader's lock on an object an L2 store was reading waits for the store, then
    for a look of the reap (``stalled``): reservations taking every budget kept it forever."""
    (obj,) = store(l1, 1, 1, fill=0x55)
    l1.reserve_read([obj.key])  # the reader that dies
    reading = list(l1.reserve_store([obj.key]).values())
    later = obj.lock_deadline + TTL  # every reservation made below is due by then
    assert l1.expire_locks(later, budget=BUDGET) == 0  # the store still reads: stalled
    l1.finish_store(reading)
    assert obj.read_locks == 1
    for step in range(MASS // BUDGET):
        l1.reserve_write(keys(200 + step, BUDGET), [ALIGN] * BUDGET)  # writers that die
        l1.expire_locks(later, budget=BUDGET)
    assert obj.read_locks == 0 and l1.stats().read_locks == 0
