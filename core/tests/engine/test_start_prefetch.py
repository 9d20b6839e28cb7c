"""StorageManager.start_prefetch: a lookup with nothing left for L2 is answered at once."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import pytest
from engine_support import (
    gated_backend,
    keys_of,
    mock,
    parked_prefetch,
    payload,
    spec,
    store,
    store_in_l2_only,
)

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.storage import StorageManager

Engine = Callable[..., StorageManager]
SIZE = 64 * 1024


def assert_no_read_locks(storage: StorageManager) -> None:
    stats = storage.l1.stats()
    assert (stats.write_locked, stats.read_locks) == (0, 0)


def test_an_all_l1_lookup_is_answered_with_the_locked_prefix(engine: Engine) -> None:
    storage = engine([mock()])
    keys = keys_of(30, 4)
    store(storage, keys, SIZE)
    assert storage.flush(10)  # L2 store tasks hold read locks of their own until done
    # A repeated key ends the prefix, as with submit_prefetch.
    handle, locked = storage.start_prefetch(keys[:3] + keys[:1], readers=2)
    assert locked == keys[:3]
    assert storage.query_prefetch(handle) == 0  # nothing was kept to collect
    assert storage.l1.stats().read_locks == 6
    storage.release(locked, 2)
    with pytest.raises(ValueError):
        storage.start_prefetch(keys, readers=0)
    assert_no_read_locks(storage)


def test_without_adapters_the_l1_prefix_is_the_answer(engine: Engine) -> None:
    storage = engine([])
    keys = keys_of(32, 3)
    store(storage, keys[:2], SIZE)
    handle, locked = storage.start_prefetch(keys)
    assert locked == keys[:2]
    assert storage.query_prefetch(handle) == 0
    storage.release(locked)
    assert_no_read_locks(storage)


def test_l2_work_is_left_to_the_controller(engine: Engine) -> None:
    storage = engine([mock()])
    keys = keys_of(31, 3)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.l1.delete(keys[1:])
    handle, locked = storage.start_prefetch(keys)
    assert locked is None
    assert storage.wait_prefetch(handle, 10) == 3
    assert [obj.key for obj in storage.read(keys)] == keys
    storage.release(keys, 2)  # the read above and the prefetch's own lock
    assert_no_read_locks(storage)


# -- adapters answering from memory (ImmediateLookups) ------------------------------------


def test_an_l2_miss_answered_from_memory_is_settled_on_the_callers_thread(engine: Engine) -> None:
    storage = engine([mock()])
    keys = keys_of(40, 4)
    store(storage, keys[:2], SIZE)
    assert storage.flush(10)
    handle, locked = storage.start_prefetch(keys)
    assert locked == keys[:2]  # L1 prefix, and the adapter knew at once it has nothing more
    assert storage.query_prefetch(handle) == 0
    stats = storage.adapters[0].stats()
    assert stats["lookups_answered_now"] == 1 and stats.get("lookup_tasks", 0) == 0
    assert storage.adapters[0].pinned_keys() == {}
    storage.release(locked)
    assert_no_read_locks(storage)


def test_an_l2_hit_answered_from_memory_is_loaded_without_a_lookup_task(engine: Engine) -> None:
    storage = engine([mock()])
    keys = keys_of(41, 3)
    store_in_l2_only(storage, keys, SIZE)
    handle, locked = storage.start_prefetch(keys)
    assert locked is None
    assert storage.wait_prefetch(handle, 10) == 3
    stats = storage.adapters[0].stats()
    assert stats["lookups_answered_now"] == 1 and stats.get("lookup_tasks", 0) == 0
    assert [bytes(storage.view(obj)) for obj in storage.read(keys)] == [payload(key, SIZE) for key in keys]
    storage.release(keys, 2)
    assert storage.adapters[0].pinned_keys() == {}
    assert_no_read_locks(storage)


def test_adapters_that_cannot_answer_at_once_are_asked_by_the_controller(engine: Engine) -> None:
    # A simulated latency makes the mock answer on its worker thread only.
    storage = engine([mock(), mock(latency_s=0.001, namespace="slow-index")])
    keys = keys_of(42, 3)
    handle, locked = storage.start_prefetch(keys)
    assert locked is None  # the second adapter still has to be asked
    assert storage.wait_prefetch(handle, 10) == 0
    fast, slow = (adapter.stats() for adapter in storage.adapters)
    assert fast["lookups_answered_now"] == 1 and fast.get("lookup_tasks", 0) == 0
    assert slow.get("lookups_answered_now", 0) == 0 and slow["lookup_tasks"] == 1
    assert all(adapter.pinned_keys() == {} for adapter in storage.adapters)
    assert_no_read_locks(storage)


def test_answers_taken_at_submission_shrink_when_l1_got_the_keys_meanwhile(engine: Engine) -> None:
    storage = engine([spec({"type": "gated_now"})], l2_prefetch_max_in_flight=1)
    backend = gated_backend(storage)
    adapter = storage.adapters[0]
    waiting = keys_of(43, 4)
    store_in_l2_only(storage, waiting[1:], SIZE)  # L2 misses the first key: [miss, hit, hit, hit]
    parked = parked_prefetch(storage, keys_of(44, 2), SIZE)  # holds the only prefetch slot
    handle, locked = storage.start_prefetch(waiting)
    assert locked is None
    pins = adapter.pinned_keys()
    assert waiting[0] not in pins and all(pins.get(key) == 1 for key in waiting[1:])  # pinned at once
    # The first two become READY in L1 before the queued request starts: the answers for
    # the other two (hits) must be the ones it goes by, not the first two (a miss, a hit).
    store(storage, waiting[:2], SIZE)
    backend.gate.set()
    assert storage.wait_prefetch(parked, 10) == 2
    assert storage.wait_prefetch(handle, 10) == 4
    objects = storage.read(waiting)
    assert [bytes(storage.view(obj)) for obj in objects] == [payload(key, SIZE) for key in waiting]
    storage.release(waiting, 2)
    storage.release(keys_of(44, 2))
    assert storage.flush(10)
    assert adapter.pinned_keys() == {}
    assert_no_read_locks(storage)


# -- releases beside a lock another holder forgot -----------------------------------------

#: a short lock TTL: read-lock deadlines fall on a grid of a 64th of it (31 ms)
SHORT_LOCK_TTL = 2.0


def next_lock_step() -> None:
    """Locks taken after this expire at a later grid deadline than those taken before."""
    time.sleep(3 * SHORT_LOCK_TTL / 64)


def forgotten_lock(storage: StorageManager, keys: list[ObjectKey]) -> float:
    """Read-lock ``keys`` for a holder that forgets the locks (never releases them); the
    deadline they expire at."""
    objects = storage.read(keys)
    assert len(objects) == len(keys)
    deadline = objects[0].lock_deadline
    next_lock_step()
    return deadline


def assert_only_live_locks_after_the_reaper(
    storage: StorageManager, keys: list[ObjectKey], forgotten: float, live: int
) -> None:
    # The forgotten locks expire; whatever is left must be held by a live holder.
    storage.l1.expire_locks(forgotten)
    for key in keys:
        obj = storage.l1.get(key)
        assert obj is not None and obj.read_locks == live, (
            "a released lock lives on in place of a forgotten one"
        )


def test_a_release_told_when_its_locks_were_taken_never_drops_a_forgotten_lock(engine: Engine) -> None:
    storage = engine([], l1_lock_ttl_s=SHORT_LOCK_TTL)
    keys = keys_of(45, 2)
    store(storage, keys, SIZE)
    forgotten = forgotten_lock(storage, keys)
    started = time.monotonic()
    assert len(storage.read(keys)) == 2  # this caller's locks
    next_lock_step()
    assert len(storage.read(keys)) == 2  # a hot prefix: another reader's, still held
    storage.release(keys, not_before=storage.l1.lock_deadline(started))
    assert_only_live_locks_after_the_reaper(storage, keys, forgotten, live=1)
    storage.release(keys)
    assert_no_read_locks(storage)


def test_an_all_l1_result_given_back_never_drops_a_forgotten_lock(engine: Engine) -> None:
    storage = engine([], l1_lock_ttl_s=SHORT_LOCK_TTL)
    keys = keys_of(46, 2)
    store(storage, keys, SIZE)
    forgotten = forgotten_lock(storage, keys)
    handle = storage.submit_prefetch(keys)  # every key in L1: a result held at once
    next_lock_step()
    assert len(storage.read(keys)) == 2  # another reader's, still held
    storage.discard_prefetch(handle)  # its locks are given back
    assert_only_live_locks_after_the_reaper(storage, keys, forgotten, live=1)
    storage.release(keys)
    assert_no_read_locks(storage)


def test_a_lookup_settled_at_once_is_counted_without_a_log_line(engine: Engine, caplog) -> None:
    """Most lookups end on the caller's thread (all in L1, or no adapter to ask): they
    are counted as every lookup is -- the distinct keys of the prefix asked for, the L1
    hits -- and log nothing, a line per lookup being most of their cost at DEBUG."""
    storage = engine([])
    keys = keys_of(50, 4)
    store(storage, keys[:2], SIZE)
    with caplog.at_level(logging.DEBUG, logger="lmcache_tiers.controllers.prefetch"):
        _, all_hits = storage.start_prefetch(keys[:2])
        _, part = storage.start_prefetch(keys + keys[:1])  # a repeat ends the prefix asked for
        _, none = storage.start_prefetch(keys[2:])
    assert (all_hits, part, none) == (keys[:2], keys[:2], [])
    requests = storage.status()["requests"]
    assert (requests["lookups"], requests["lookup_keys"], requests["l1_hit_chunks"]) == (3, 2 + 4 + 2, 2 + 2)
    assert "Prefetch request submitted" not in caplog.text
    storage.release(keys[:2], 2)
    assert_no_read_locks(storage)
