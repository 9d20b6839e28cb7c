"""L1Manager: object states, counted read locks, TTLs, temporaries, listeners, eviction.

The state machine is backing-independent, so these tests run on the shared-memory arena
and on the NVMe file alike; only tests of memory views are memory-only.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object, L1Stats, ObjectState
from lmcache_tiers.l1 import reads as reads_module

ALIGN = 4096
CAPACITY = 64 * ALIGN
LOCK_TTL = 30.0
WRITE_TTL = 60.0

Event = tuple[str, list[ObjectKey]]


def key(index: int) -> ObjectKey:
    return ObjectKey("test-model", 0, index.to_bytes(8, "big"))


def keys(*indices: int) -> list[ObjectKey]:
    return [key(index) for index in indices]


class Recorder:
    """Records notifications as (event, keys); several recorders may share one log."""

    def __init__(self, name: str = "", log: list[tuple[str, str, list[ObjectKey]]] | None = None) -> None:
        self.name = name
        self.log: list[tuple[str, str, list[ObjectKey]]] = [] if log is None else log

    def on_l1_keys_written(self, written: Sequence[ObjectKey]) -> None:
        self.log.append((self.name, "written", list(written)))

    def on_l1_keys_read(self, read: Sequence[ObjectKey]) -> None:
        self.log.append((self.name, "read", list(read)))

    def on_l1_keys_deleted(self, deleted: Sequence[ObjectKey]) -> None:
        self.log.append((self.name, "deleted", list(deleted)))

    @property
    def events(self) -> list[Event]:
        return [(event, event_keys) for _, event, event_keys in self.log]


def make_manager(nvme_dir: Path | None = None) -> L1Manager:
    return L1Manager(
        CAPACITY,
        align=ALIGN,
        lock_ttl_s=LOCK_TTL,
        write_ttl_s=WRITE_TTL,
        prefault=False,
        nvme_path=None if nvme_dir is None else str(nvme_dir),
    )


@pytest.fixture(params=["memory", "nvme"])
def l1(request: pytest.FixtureRequest) -> Iterator[L1Manager]:
    manager = make_manager(request.getfixturevalue("nvme_dir") if request.param == "nvme" else None)
    yield manager
    manager.close()


@pytest.fixture
def memory_l1() -> Iterator[L1Manager]:
    manager = make_manager()
    yield manager
    manager.close()


@pytest.fixture
def recorder(l1: L1Manager) -> Recorder:
    listener = Recorder()
    l1.add_listener(listener)
    return listener


def write(l1: L1Manager, indices: Sequence[int], size: int = ALIGN, *, temporary: bool = False) -> None:
    """Store objects whose bytes are their index, READY."""
    reserved = l1.reserve_write(keys(*indices), [size] * len(indices), temporary=temporary)
    for obj in reserved.values():
        l1.write_object(obj, memoryview(bytes([int.from_bytes(obj.key.chunk_hash, "big") % 256]) * obj.size))
    assert all(l1.finish_write(list(reserved)))


def read(l1: L1Manager, obj: L1Object) -> bytes:
    out = bytearray(obj.size)
    l1.read_object(obj, memoryview(out))
    return bytes(out)


def later(seconds: float) -> float:
    return time.monotonic() + seconds


# -- writing -------------------------------------------------------------------------------


def test_write_then_ready_with_bytes_in_the_arena(memory_l1: L1Manager) -> None:
    l1 = memory_l1
    recorder = Recorder()
    l1.add_listener(recorder)
    reserved = l1.reserve_write(keys(1, 2), [100, 5000])
    assert list(reserved) == keys(1, 2)
    first, second = reserved.values()
    assert (first.size, second.size) == (100, 5000)
    assert first.offset % ALIGN == 0 and second.offset % ALIGN == 0
    assert first.state is ObjectState.WRITING and first.read_locks == 0 and not first.temporary
    assert l1.stats() == L1Stats(objects=2, used_bytes=3 * ALIGN, write_locked=2, read_locks=0, temporary=0)
    assert l1.contains(key(1)) and l1.prefix_hits(keys(1, 2)) == 0
    view = l1.view(first)
    view[:] = b"a" * 100
    assert bytes(l1.arena.buffer[first.offset : first.offset + 100]) == b"a" * 100
    view.release()
    assert recorder.events == []

    assert l1.finish_write(keys(1, 2, 3)) == [True, True, False]
    assert reserved[key(1)].state is ObjectState.READY  # the same object, now READY
    assert l1.get(key(1)) is first
    assert recorder.events == [("written", keys(1, 2))]
    assert l1.stats().write_locked == 0
    assert l1.prefix_hits(keys(1, 2, 3)) == 2
    assert l1.finish_write(keys(1)) == [False]  # already READY
    assert recorder.events == [("written", keys(1, 2))]


def test_reserve_write_skips_keys_present_in_any_state(l1: L1Manager) -> None:
    write(l1, [1])
    l1.reserve_write(keys(2), [ALIGN])  # still WRITING
    reserved = l1.reserve_write(keys(1, 2, 3, 3), [ALIGN, ALIGN, ALIGN, 2 * ALIGN])
    assert list(reserved) == keys(3)  # 3 repeated: the first occurrence wins
    assert reserved[key(3)].size == ALIGN
    assert l1.reserve_write(keys(1, 2, 3), [ALIGN] * 3) == {}
    assert l1.used_bytes == 3 * ALIGN


def test_out_of_memory_reserves_nothing(l1: L1Manager, recorder: Recorder) -> None:
    write(l1, [1])
    before = (l1.stats(), l1.fragmentation())
    with pytest.raises(L1OutOfMemoryError, match="cannot hold 2 new objects"):
        l1.reserve_write(keys(1, 2, 3), [ALIGN, 40 * ALIGN, 40 * ALIGN])
    assert (l1.stats(), l1.fragmentation()) == before
    assert not l1.contains(key(2)) and not l1.contains(key(3))
    assert recorder.events == [("written", keys(1))]
    # The same batch fits once memory is there: the failure left no partial reservation.
    assert list(l1.reserve_write(keys(2, 3), [ALIGN, 40 * ALIGN])) == keys(2, 3)


def test_reserve_write_checks_lengths_and_sizes(l1: L1Manager) -> None:
    with pytest.raises(ValueError, match="2 keys but 1 sizes"):
        l1.reserve_write(keys(1, 2), [ALIGN])
    with pytest.raises(ValueError, match="negative"):
        l1.reserve_write(keys(1, 2), [ALIGN, -5])
    assert len(l1) == 0 and l1.used_bytes == 0


def test_abort_write_frees_only_objects_being_written(l1: L1Manager, recorder: Recorder) -> None:
    write(l1, [1])
    l1.reserve_write(keys(2, 3), [ALIGN, ALIGN])
    l1.abort_write(keys(1, 2, 3, 4))
    assert l1.contains(key(1))
    assert not l1.contains(key(2)) and not l1.contains(key(3))
    assert l1.used_bytes == ALIGN
    assert recorder.events == [("written", keys(1)), ("deleted", keys(2, 3))]
    assert l1.finish_write(keys(2)) == [False]


def test_view_of_an_object_that_left_l1_is_refused(l1: L1Manager) -> None:
    obj = l1.reserve_write(keys(1), [ALIGN])[key(1)]
    l1.abort_write(keys(1))
    with pytest.raises(KeyError):
        l1.view(obj)


# -- reading -------------------------------------------------------------------------------


def test_read_locks_are_counted_per_ready_key(l1: L1Manager, recorder: Recorder) -> None:
    write(l1, [1, 3])
    l1.reserve_write(keys(4), [ALIGN])  # WRITING: not readable
    hits = l1.reserve_read(keys(1, 2, 3, 4, 1), count=2)
    assert list(hits) == keys(1, 3)  # every READY key, not only the prefix; repeats once
    assert hits[key(1)].read_locks == 2
    assert read(l1, hits[key(3)])[:2] == b"\x03\x03"
    assert l1.stats().read_locks == 4
    l1.reserve_read(keys(1))
    assert hits[key(1)].read_locks == 3
    assert recorder.events[-2:] == [("read", keys(1, 3)), ("read", keys(1))]

    l1.finish_read(keys(1, 3))
    assert (hits[key(1)].read_locks, hits[key(3)].read_locks) == (2, 1)
    l1.finish_read(keys(1, 1, 1))  # a key listed again is released once
    assert hits[key(1)].read_locks == 1
    l1.reserve_read(keys(1))
    l1.finish_read(keys(1, 3), count=5)  # never below zero
    assert (hits[key(1)].read_locks, hits[key(3)].read_locks) == (0, 0)
    assert l1.contains(key(1)) and l1.contains(key(3))  # not temporary: stays
    assert l1.stats().read_locks == 0


def test_a_miss_notifies_nobody(l1: L1Manager, recorder: Recorder) -> None:
    assert l1.reserve_read(keys(9)) == {}
    assert recorder.events == []


def test_lock_count_must_be_positive(l1: L1Manager) -> None:
    write(l1, [1])
    for call in (l1.reserve_read, l1.finish_read, l1.finish_write_and_reserve_read):
        with pytest.raises(ValueError, match="at least 1"):
            call(keys(1), 0)


def test_temporary_object_is_freed_with_its_last_read_lock(l1: L1Manager, recorder: Recorder) -> None:
    write(l1, [1, 2], temporary=True)
    assert l1.stats().temporary == 2
    l1.reserve_read(keys(1, 2), count=2)
    l1.finish_read(keys(1, 2))
    assert l1.contains(key(1)) and l1.contains(key(2))
    l1.finish_read(keys(1, 2))
    assert not l1.contains(key(1)) and not l1.contains(key(2))
    assert l1.used_bytes == 0 and l1.stats().temporary == 0
    assert recorder.events[-1] == ("deleted", keys(1, 2))


def test_finish_write_and_reserve_read_hands_over_atomically(l1: L1Manager, recorder: Recorder) -> None:
    l1.reserve_write(keys(1, 2), [ALIGN, ALIGN], temporary=True)
    assert l1.finish_write_and_reserve_read(keys(1, 2, 3), count=2) == [True, True, False]
    obj = l1.get(key(1))
    assert obj is not None and obj.state is ObjectState.READY and obj.read_locks == 2
    assert recorder.events == [("written", keys(1, 2))]
    # Locked, so neither eviction nor delete can take it before the reader has it.
    assert l1.evict(CAPACITY, keys(1, 2)) == []
    assert l1.delete(keys(1)) == [False]
    assert l1.finish_write_and_reserve_read(keys(1)) == [False]  # not WRITING any more
    l1.finish_read(keys(1, 2), count=2)
    assert len(l1) == 0
    assert recorder.events[-1] == ("deleted", keys(1, 2))


def test_set_temporary_retains_or_releases(l1: L1Manager) -> None:
    l1.reserve_write(keys(1, 2), [ALIGN, ALIGN], temporary=True)
    l1.finish_write_and_reserve_read(keys(1, 2))
    l1.set_temporary(keys(1, 9), False)  # a retaining prefetch policy keeps key 1
    assert l1.stats().temporary == 1
    l1.finish_read(keys(1, 2))
    assert l1.contains(key(1)) and not l1.contains(key(2))

    l1.set_temporary(keys(1), True)  # unlocked: not freed on the spot...
    assert l1.contains(key(1))
    l1.reserve_read(keys(1))
    l1.finish_read(keys(1))  # ...but when its next reader is done
    assert not l1.contains(key(1))


def test_prefix_hits_counts_leading_ready_keys(l1: L1Manager) -> None:
    write(l1, [1, 2, 4])
    l1.reserve_write(keys(3), [ALIGN])
    assert l1.prefix_hits(keys(1, 2, 3, 4)) == 2
    assert l1.prefix_hits(keys(1, 2, 5, 4)) == 2
    assert l1.prefix_hits(keys(4, 1)) == 2
    assert l1.prefix_hits(keys(5, 1)) == 0
    assert l1.prefix_hits([]) == 0


def test_reserve_read_prefix_locks_the_leading_ready_keys(l1: L1Manager, recorder: Recorder) -> None:
    write(l1, [1, 2, 4])
    l1.reserve_write(keys(3), [ALIGN])
    prefix = l1.reserve_read_prefix(keys(1, 2, 1, 3, 4), count=2)
    assert [obj.key for obj in prefix] == keys(1, 2, 1)
    # The repeated key is locked once; key 4, past the gap, is not locked at all.
    objects = [l1.get(k) for k in keys(1, 2, 4)]
    assert [obj.read_locks if obj else None for obj in objects] == [2, 2, 0]
    assert recorder.events[-1] == ("read", keys(1, 2))
    assert l1.reserve_read_prefix(keys(3, 1)) == []
    assert l1.reserve_read_prefix([]) == []
    l1.finish_read(keys(1, 2), count=2)
    assert l1.stats().read_locks == 0


def test_reserve_read_prefix_until_repeat_ends_before_the_first_repeat(
    l1: L1Manager, recorder: Recorder
) -> None:
    write(l1, [1, 2, 3])
    prefix = l1.reserve_read_prefix(keys(1, 2, 1, 3), until_repeat=True)
    assert [obj.key for obj in prefix] == keys(1, 2)
    assert [obj.read_locks for obj in (l1.get(k) for k in keys(1, 2, 3)) if obj] == [1, 1, 0]
    assert recorder.events[-1] == ("read", keys(1, 2))
    # Without a repeat, the whole READY prefix, reported with the caller's keys.
    prefix = l1.reserve_read_prefix(keys(3, 2, 4), until_repeat=True)
    assert [obj.key for obj in prefix] == keys(3, 2)
    assert recorder.events[-1] == ("read", keys(3, 2))
    l1.finish_read(keys(1, 3))
    l1.finish_read(keys(2), count=2)
    assert l1.stats().read_locks == 0


def test_reserve_read_prefix_of_the_same_keys_again_sees_every_change_between(
    l1: L1Manager, recorder: Recorder
) -> None:
    """The keys of the last full hit are remembered with their objects while no READY
    object comes or goes: each call still locks and reports, and whatever changed in
    between (the caller's list, L1's objects, the list handed out) is seen."""
    write(l1, [1, 2, 3])
    wanted = keys(1, 2, 3)
    for times in (1, 2):
        prefix = l1.reserve_read_prefix(wanted)
        assert [obj.key for obj in prefix] == wanted
        assert [l1.get(k).read_locks for k in wanted] == [times] * 3  # type: ignore[union-attr]
        assert recorder.events[-1] == ("read", wanted)
    prefix.clear()  # the caller's to keep: the next call is not affected
    assert len(l1.reserve_read_prefix(wanted)) == 3
    wanted[1] = key(9)  # changed in place by the caller
    assert [obj.key for obj in l1.reserve_read_prefix(wanted)] == keys(1)
    wanted[1] = key(2)
    assert l1.delete(keys(2), force=True) == [True]  # a READY object goes
    assert [obj.key for obj in l1.reserve_read_prefix(wanted)] == keys(1)
    write(l1, [2])  # and a new object of the same key comes
    prefix = l1.reserve_read_prefix(wanted)
    assert prefix[1] is l1.get(key(2)) and prefix[1].read_locks == 1
    assert [l1.get(k).read_locks for k in keys(1, 3)] == [6, 4]  # type: ignore[union-attr]
    l1.finish_read(keys(1), count=6)
    l1.finish_read(keys(3), count=4)
    l1.finish_read(keys(2), count=3)  # the deleted object's locks, on its held extent
    assert prefix[1].read_locks == 1
    l1.finish_read(keys(2))
    assert l1.stats().read_locks == 0


def test_a_listener_reordering_the_keys_it_is_told_never_changes_what_a_lookup_finds(
    l1: L1Manager,
) -> None:
    """Listeners (an eviction policy plugin among them) are handed lists of keys; one that
    reorders such a list in place must not make a later lookup hand out one key's object
    at another key's position."""

    class Reverser(Recorder):
        def on_l1_keys_read(self, read: Sequence[ObjectKey]) -> None:
            read.reverse()  # type: ignore[attr-defined]

    write(l1, [1, 2, 3])
    l1.add_listener(Reverser())
    for wanted in (keys(1, 2, 3), keys(3, 2, 1), keys(1, 2, 3), keys(3, 2, 1)):
        prefix = l1.reserve_read_prefix(list(wanted))
        assert [obj.key for obj in prefix] == wanted
        l1.finish_read(wanted)
        assert l1.stats().read_locks == 0


def test_finish_read_of_the_last_full_hit_releases_its_objects_and_sees_every_change_between(
    l1: L1Manager,
) -> None:
    """A release of the very keys the last full hit locked takes that hit's objects while
    no READY object came or went; counts, forced deletes and temporaries work as ever."""
    write(l1, [1, 2, 3])
    wanted = keys(1, 2, 3)
    l1.reserve_read_prefix(wanted)
    l1.reserve_read_prefix(wanted)
    l1.finish_read(keys(1, 2, 3))  # equal keys, another list
    assert [l1.get(k).read_locks for k in wanted] == [1, 1, 1]  # type: ignore[union-attr]
    assert l1.stats().read_locks == 3
    l1.finish_read(wanted)
    assert l1.stats().read_locks == 0
    # a key deleted by force and written again in between: its release goes to the old
    # object's held extent, not to the new object another reader holds
    l1.reserve_read_prefix(wanted)
    assert l1.delete(keys(2), force=True) == [True]
    write(l1, [2])
    l1.reserve_read(keys(2))
    l1.finish_read(wanted)
    assert l1.get(key(2)).read_locks == 1  # type: ignore[union-attr]
    assert l1.stats().read_locks == 1
    assert l1.lease_stats().quarantined_extents == 0
    l1.finish_read(keys(2))
    # a temporary object is freed with its last lock
    write(l1, [4], temporary=True)
    temporary = keys(4)
    assert len(l1.reserve_read_prefix(temporary)) == 1
    l1.finish_read(temporary)
    assert l1.get(key(4)) is None
    assert l1.stats().read_locks == 0


# -- removal -------------------------------------------------------------------------------


def test_delete_skips_locked_objects_unless_forced(l1: L1Manager, recorder: Recorder) -> None:
    write(l1, [1, 2])
    l1.reserve_write(keys(3), [ALIGN])
    l1.reserve_read(keys(2))
    assert l1.delete(keys(1, 2, 3, 4)) == [True, False, False, False]
    assert recorder.events[-1] == ("deleted", keys(1))
    # force overrides read locks, never a reservation someone is filling
    assert l1.delete(keys(2, 3), force=True) == [True, False]
    assert recorder.events[-1] == ("deleted", keys(2))
    assert len(l1) == 1 and l1.stats() == L1Stats(1, 2 * ALIGN, 1, 0, 0)  # 2's extent is held
    l1.finish_read(keys(2))  # the forced-away reader is done: its extent goes back
    assert l1.used_bytes == ALIGN and l1.lease_stats().reclaimed_released == 1
    l1.finish_read(keys(2))  # releasing once more is harmless
    l1.abort_write(keys(3))
    assert l1.used_bytes == 0


def test_evict_frees_unlocked_ready_victims_in_order_until_enough(l1: L1Manager, recorder: Recorder) -> None:
    write(l1, [1, 2, 3, 4, 5], size=2 * ALIGN)
    l1.reserve_write(keys(6), [ALIGN])
    l1.reserve_read(keys(2))
    # 3 aligned units asked: 2 is read-locked, 6 is being written, 9 is unknown, 1 repeats.
    evicted = l1.evict(3 * ALIGN, keys(9, 6, 2, 1, 1, 4, 3, 5))
    assert evicted == keys(1, 4)
    assert recorder.events[-1] == ("deleted", keys(1, 4))
    assert [l1.contains(k) for k in keys(1, 2, 3, 4, 5, 6)] == [False, True, True, False, True, True]
    assert l1.evict(0, keys(3)) == []
    assert l1.evict(CAPACITY, keys(3, 5)) == keys(3, 5)  # victims ran out first


def test_evict_stops_consuming_victims_once_enough_is_freed(l1: L1Manager) -> None:
    write(l1, [1, 2, 3])
    consumed: list[ObjectKey] = []

    def victims() -> Iterator[ObjectKey]:
        for victim in keys(1, 2, 3):
            consumed.append(victim)
            yield victim

    assert l1.evict(ALIGN, victims()) == keys(1)
    assert consumed == keys(1)


class LruPolicy:
    """A minimal eviction policy whose victim iterator walks its own live OrderedDict."""

    def __init__(self) -> None:
        self.order: OrderedDict[ObjectKey, None] = OrderedDict()

    def on_l1_keys_written(self, written: Sequence[ObjectKey]) -> None:
        for k in written:
            self.order[k] = None

    def on_l1_keys_read(self, read: Sequence[ObjectKey]) -> None:
        for k in read:
            self.order.move_to_end(k)

    def on_l1_keys_deleted(self, deleted: Sequence[ObjectKey]) -> None:
        for k in deleted:
            self.order.pop(k, None)

    def victims(self) -> Iterator[ObjectKey]:
        return iter(self.order)


def test_evict_with_a_policy_iterating_its_own_state(l1: L1Manager) -> None:
    policy = LruPolicy()
    l1.add_listener(policy)
    write(l1, [1, 2, 3, 4])
    l1.reserve_read(keys(1))
    l1.finish_read(keys(1))
    # Deleted notifications come after iteration, so the OrderedDict is not mutated under it.
    assert l1.evict(2 * ALIGN, policy.victims()) == keys(2, 3)
    assert list(policy.order) == keys(4, 1)


def test_evict_frees_what_it_took_even_if_the_victims_iterator_fails(
    l1: L1Manager, recorder: Recorder
) -> None:
    write(l1, [1, 2])

    def victims() -> Iterator[ObjectKey]:
        yield key(1)
        raise RuntimeError("policy bug")

    with pytest.raises(RuntimeError, match="policy bug"):
        l1.evict(CAPACITY, victims())
    assert not l1.contains(key(1)) and l1.used_bytes == ALIGN
    assert recorder.events[-1] == ("deleted", keys(1))


def test_clear_skips_locked_objects_unless_forced(l1: L1Manager, recorder: Recorder) -> None:
    write(l1, [1, 2, 3])
    l1.reserve_read(keys(2))
    l1.reserve_write(keys(4), [ALIGN])
    assert l1.clear() == 2
    assert [l1.contains(k) for k in keys(1, 2, 3, 4)] == [False, True, False, True]
    assert l1.clear(force=True) == 1  # the reservation of 4 is left to its writer
    assert [l1.contains(k) for k in keys(2, 4)] == [False, True]
    assert recorder.events[-2:] == [("deleted", keys(1, 3)), ("deleted", keys(2))]
    l1.finish_read(keys(2))
    assert l1.finish_write(keys(4)) == [True]
    assert l1.used_bytes == ALIGN


# -- lock expiry ---------------------------------------------------------------------------


def test_expired_write_reservation_is_freed(
    l1: L1Manager, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    l1.reserve_write(keys(1, 2), [ALIGN, ALIGN])
    assert l1.expire_locks(later(WRITE_TTL / 2)) == 0
    assert l1.contains(key(1))
    with caplog.at_level(logging.WARNING):
        assert l1.expire_locks(later(WRITE_TTL + 1)) == 2
    assert "2 write reservations freed" in caplog.text
    assert len(l1) == 0
    assert recorder.events == [("deleted", keys(1, 2))]
    assert l1.finish_write(keys(1)) == [False]  # the crashed writer's commit arrives too late
    # the extents stay out of reach for the grace period, in case the writer is only slow
    assert l1.used_bytes == 2 * ALIGN and l1.lease_stats().quarantined_expired == 2
    assert l1.expire_locks(later(WRITE_TTL + 1 + LOCK_TTL + 1)) == 0
    assert l1.used_bytes == 0 and l1.lease_stats().reclaimed_lease_end == 2


def test_expired_read_locks_are_dropped_and_temporaries_freed(l1: L1Manager, recorder: Recorder) -> None:
    write(l1, [1])
    write(l1, [2], temporary=True)
    l1.reserve_read(keys(1, 2), count=3)
    assert l1.expire_locks(later(LOCK_TTL / 2)) == 0
    assert l1.stats().read_locks == 6
    assert l1.expire_locks(later(LOCK_TTL + 1)) == 2
    obj = l1.get(key(1))
    assert obj is not None and obj.read_locks == 0
    assert not l1.contains(key(2))
    assert recorder.events[-1] == ("deleted", keys(2))
    # 2's extent is held for the grace period, like 1's if it left L1 within it
    assert l1.stats() == L1Stats(objects=1, used_bytes=2 * ALIGN, write_locked=0, read_locks=0, temporary=0)
    assert l1.delete(keys(1)) == [True]  # unlocked again, so deletable
    assert l1.used_bytes == 2 * ALIGN
    assert l1.expire_locks(later(10 * WRITE_TTL)) == 0
    assert l1.used_bytes == 0


def test_a_new_reader_extends_the_read_lock_deadline(l1: L1Manager) -> None:
    write(l1, [1])
    l1.reserve_read(keys(1))
    obj = l1.get(key(1))
    assert obj is not None
    first_deadline = obj.lock_deadline
    l1.reserve_read(keys(1))
    assert obj.lock_deadline >= first_deadline
    assert l1.expire_locks(first_deadline - 1) == 0
    assert l1.expire_locks(obj.lock_deadline + 1) == 1


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The clock read locks take their deadlines from (and releases their now), set by the
    test; it starts on the lock-deadline grid (a 64th of the TTL), so that a lock taken then
    expires exactly its TTL later."""
    step = LOCK_TTL / 64
    now = [math.ceil(time.monotonic() / step) * step]
    monkeypatch.setattr(reads_module, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_an_expired_read_lock_is_reaped_however_often_the_key_is_locked_again(
    l1: L1Manager, clock: list[float]
) -> None:
    # Holders forget expired locks without releasing them.  A key locked again and again
    # (a prefix an engine looks up every step) must not keep such a lock alive: the
    # object would never be evictable or deletable again.
    write(l1, [1])
    obj = l1.get(key(1))
    assert obj is not None
    start = clock[0]
    l1.reserve_read(keys(1))  # its holder dies with it
    previous = 0.0
    for step in range(1, 13):  # a reader every quarter of the TTL, each done a step later
        clock[0] = start + step * LOCK_TTL / 4
        l1.reserve_read_prefix(keys(1))
        if step > 1:  # the reader before is done with the lock it took (and knows when)
            l1.finish_read(keys(1), not_before=previous)
        previous = clock[0] + LOCK_TTL
        assert l1.expire_locks(clock[0]) == (1 if step == 4 else 0), step
        assert obj.read_locks == (2 if step < 4 else 1)
        if step == 4:  # the dead lock's extent keeps its grace period
            assert l1.lease_stats().lapsed_objects == 1
    l1.finish_read(keys(1), not_before=previous)
    assert not obj.locked and l1.delete(keys(1)) == [True]


def test_a_release_never_shortens_a_live_holders_lock(l1: L1Manager, clock: list[float]) -> None:
    write(l1, [1])
    obj = l1.get(key(1))
    assert obj is not None
    start = clock[0]
    l1.reserve_read(keys(1))  # A, who dies holding it
    clock[0] = start + LOCK_TTL / 2
    l1.reserve_read(keys(1))  # B
    clock[0] = start + 0.9 * LOCK_TTL
    l1.reserve_read(keys(1), count=2)  # C, two locks
    clock[0] = start + 1.2 * LOCK_TTL  # A's lock has expired; the reaper has not run yet
    l1.finish_read(keys(1))  # B is done
    # A's lock goes at its deadline; C's two last until theirs, whichever lock B's
    # release took
    assert l1.expire_locks(start + 1.6 * LOCK_TTL) == 1
    assert obj.read_locks == 2
    clock[0] = start + 1.7 * LOCK_TTL
    l1.finish_read(keys(1))  # one of C's
    assert l1.expire_locks(start + 1.85 * LOCK_TTL) == 0
    assert obj.read_locks == 1
    # C's deadline (taken at 0.9 TTL, rounded up to the lock grid)
    assert l1.expire_locks(start + 1.95 * LOCK_TTL) == 1
    assert not obj.locked


def test_a_release_of_a_lock_that_expired_a_moment_ago_never_drops_another_holders(
    l1: L1Manager, clock: list[float]
) -> None:
    # A holder saw its lock live (its deadline, given as not_before, after the time it
    # read), and the lock expired before its release reached L1, the reaper not run yet:
    # the release must drop that lock, not another holder's live one in its place.
    write(l1, [1])
    obj = l1.get(key(1))
    assert obj is not None
    start = clock[0]
    l1.reserve_read(keys(1))  # A
    mine = start + LOCK_TTL  # A's deadline (the clock starts on the lock grid)
    clock[0] = start + LOCK_TTL / 2
    l1.reserve_read(keys(1))  # B, still holding it
    clock[0] = mine + LOCK_TTL / 1000  # A's release arrives just after its deadline
    l1.finish_read(keys(1), not_before=mine)
    assert obj.read_locks == 1
    assert l1.expire_locks(clock[0]) == 0  # B's lock is not due
    assert obj.read_locks == 1 and obj.locked


def test_an_l2_stores_lock_never_takes_a_readers_deadline(l1: L1Manager, clock: list[float]) -> None:
    # A store's lock has no deadline (it is never reaped): its report must not take the
    # place of a reader's, nor a reader's release the store's.
    write(l1, [1])
    obj = l1.get(key(1))
    assert obj is not None
    start = clock[0]
    l1.reserve_read(keys(1))
    stored = list(l1.reserve_store(keys(1)).values())
    l1.finish_read(keys(1), count=2)  # more than the reader holds: the store keeps its own
    assert obj.read_locks == 1 and obj.locked
    l1.reserve_read(keys(1))
    l1.finish_store(stored)
    assert obj.read_locks == 1
    assert l1.expire_locks(start + LOCK_TTL - 1) == 0
    assert l1.expire_locks(start + LOCK_TTL) == 1
    assert not obj.locked


def test_lock_deadlines_are_the_ttl_rounded_up_to_the_lock_grid(memory_l1: L1Manager) -> None:
    step = memory_l1.lock_grid_s
    assert step == LOCK_TTL / 64
    start = time.monotonic()
    times = sorted(start + offset * step / 7 for offset in range(-300, 300))
    deadlines = [memory_l1.lock_deadline(now) for now in times]
    assert deadlines == sorted(deadlines)  # an earlier time never gets a later deadline
    for now, deadline in zip(times, deadlines, strict=True):
        assert now + LOCK_TTL <= deadline < now + LOCK_TTL + step
        assert deadline == round(deadline / step) * step  # on the grid: one float per cell
    assert len(set(deadlines)) <= 600 // 7 + 2


def test_locking_the_same_keys_again_and_again_keeps_a_count_per_deadline(clock: list[float]) -> None:
    # A client that locks keys again and again without releasing them (buggy, or hostile)
    # over a whole TTL: each object keeps a count per deadline of the lock grid, not an
    # entry per lock.
    many = keys(*range(512))
    manager = L1Manager(
        len(many) * ALIGN, align=ALIGN, lock_ttl_s=LOCK_TTL, write_ttl_s=WRITE_TTL, prefault=False
    )
    try:
        write(manager, range(len(many)))
        objs = [manager.get(each) for each in many]
        start = clock[0]
        for step in range(10_000):
            clock[0] = start + step * LOCK_TTL / 10_000
            assert len(manager.reserve_read_prefix(many)) == len(many)
        for obj in objs:
            assert obj is not None and obj.read_locks == 10_000
            # deadlines rounded up to a 64th of the TTL: at most 65 within a TTL
            assert len(obj.lock_groups or ()) <= 2 * 66
        manager.finish_read(many, count=10_000)
        assert not any(obj is not None and obj.locked for obj in objs)
        assert manager.stats().read_locks == 0
        assert manager.expire_locks(start + 3 * LOCK_TTL) == 0
    finally:
        manager.close()


def test_hand_off_read_lock_uses_the_read_ttl(l1: L1Manager) -> None:
    l1.reserve_write(keys(1), [ALIGN], temporary=True)
    l1.finish_write_and_reserve_read(keys(1))
    assert l1.expire_locks(later(LOCK_TTL + 1)) == 1
    assert not l1.contains(key(1))


# -- listeners -----------------------------------------------------------------------------


def test_listeners_are_called_in_registration_order_per_call(l1: L1Manager) -> None:
    log: list[tuple[str, str, list[ObjectKey]]] = []
    l1.add_listener(Recorder("store", log))
    l1.add_listener(Recorder("eviction", log))
    write(l1, [1, 2])
    l1.reserve_read(keys(2))
    l1.finish_read(keys(2))
    l1.delete(keys(1))
    assert log == [
        ("store", "written", keys(1, 2)),
        ("eviction", "written", keys(1, 2)),
        ("store", "read", keys(2)),
        ("eviction", "read", keys(2)),
        ("store", "deleted", keys(1)),
        ("eviction", "deleted", keys(1)),
    ]


def test_a_failing_listener_does_not_fail_the_call_or_the_others(
    l1: L1Manager, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(Recorder):
        def on_l1_keys_written(self, written: Sequence[ObjectKey]) -> None:
            raise RuntimeError("listener bug")

    after = Recorder()
    l1.add_listener(Broken())
    l1.add_listener(after)
    l1.reserve_write(keys(1), [ALIGN])
    with caplog.at_level(logging.ERROR):
        assert l1.finish_write(keys(1)) == [True]
    assert "listener bug" in caplog.text
    assert after.events == [("written", keys(1))]
    # What the listener missed (a policy not told of a write, a store not queued) is
    # counted, not only logged.
    assert l1.failures()["l1_listener_error"] == 1


def test_listener_may_call_back_into_the_manager(l1: L1Manager) -> None:
    class DropAfterWrite(Recorder):  # like a skip-L1 store policy
        def on_l1_keys_written(self, written: Sequence[ObjectKey]) -> None:
            super().on_l1_keys_written(written)
            l1.delete(written)

    listener = DropAfterWrite()
    l1.add_listener(listener)
    write(l1, [1, 2])
    assert len(l1) == 0
    assert listener.events == [("written", keys(1, 2)), ("deleted", keys(1, 2))]
    l1.remove_listener(listener)
    write(l1, [3])
    assert len(l1) == 1


def test_listeners_run_inside_the_l1_lock(l1: L1Manager) -> None:
    seen: list[bool] = []

    class Probe(Recorder):
        def on_l1_keys_written(self, written: Sequence[ObjectKey]) -> None:
            outcome: list[bool] = []
            other = threading.Thread(target=lambda: outcome.append(l1.lock.acquire(timeout=0.05)))
            other.start()
            other.join()
            seen.extend(outcome)

    l1.add_listener(Probe())
    write(l1, [1])
    assert seen == [False]


# -- accounting and lifecycle --------------------------------------------------------------


def test_usage_and_capacity(l1: L1Manager) -> None:
    assert l1.capacity_bytes == CAPACITY
    assert l1.usage() == 0.0
    write(l1, [1, 2], size=ALIGN + 1)
    assert l1.used_bytes == 4 * ALIGN
    assert l1.usage() == pytest.approx(4 / 64)
    assert l1.fragmentation() == 0.0


def test_close_releases_the_arena_and_is_idempotent() -> None:
    manager = L1Manager(CAPACITY, align=ALIGN)
    path = manager.arena.path
    write(manager, [1])
    manager.close()
    manager.close()
    assert not os.path.exists(path)
    with pytest.raises(RuntimeError, match="closed"):
        manager.reserve_write(keys(2), [ALIGN])
    with pytest.raises(RuntimeError, match="closed"):
        manager.reserve_read(keys(1))


def test_concurrent_writers_and_readers_keep_accounting_exact(l1: L1Manager) -> None:
    errors: list[BaseException] = []

    def worker(base: int) -> None:
        try:
            for round_ in range(200):
                batch = keys(*(base * 10_000 + round_ * 3 + i for i in range(3)))
                try:
                    l1.reserve_write(batch, [ALIGN, 2 * ALIGN, 100])
                except L1OutOfMemoryError:
                    l1.clear()
                    continue
                l1.finish_write(batch)
                l1.reserve_read(batch)
                l1.finish_read(batch)
                if round_ % 2:
                    l1.delete(batch)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stats = l1.stats()
    assert stats.write_locked == 0 and stats.read_locks == 0
    live = [l1.get(k) for k in keys(*range(40_000))]
    objects = [obj for obj in live if obj is not None]
    assert stats.objects == len(objects)
    assert stats.used_bytes == sum(-(-max(obj.size, 1) // ALIGN) * ALIGN for obj in objects)
    assert l1.clear() == len(objects) and l1.used_bytes == 0


def test_count_being_written_counts_the_reserved_keys_only(l1: L1Manager) -> None:
    """What a front end tells 'a writer is filling it' from 'stored' by: WRITING objects,
    a client's reservation or a prefetch's load, among the keys asked about; READY ones and
    keys L1 does not hold are not being written."""
    write(l1, [1, 2])
    writes = l1.reserve_write(keys(3, 4), [ALIGN, ALIGN])
    loads = l1.reserve_load(keys(5), [ALIGN], temporary=False)

    assert l1.count_being_written(set(keys(1, 2, 3, 4, 5, 6))) == 3
    assert l1.count_being_written(set(keys(1, 6))) == 0
    assert l1.count_being_written(set(keys(4))) == 1
    assert l1.count_being_written(set()) == 0

    l1.abort_write(list(writes))
    l1.abort_load(loads.values())
    assert l1.count_being_written(set(keys(1, 2, 3, 4, 5, 6))) == 0
