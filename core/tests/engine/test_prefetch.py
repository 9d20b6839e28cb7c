"""Prefetch controller: prefix-only loading, cascades, retention, queueing, cleanup."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest
from engine_support import GatedBackend, GatedConfig, MiB, gated_backend, keys_of, mock, payload, store

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.l2.interface import LookupResult

SIZE = 64 * 1024


def gated(**options: object) -> AdapterSpec:
    return AdapterSpec(type="gated", config=GatedConfig(**options))  # type: ignore[arg-type]


def adapter(storage, index: int = 0) -> GatedBackend:
    return gated_backend(storage, index)


def assert_no_locks(storage) -> None:
    stats = storage.l1.stats()
    assert (stats.write_locked, stats.read_locks) == (0, 0)
    for each in storage.adapters:
        assert each.pinned_keys() == {}


def wait_given_up_loads_settled(storage) -> None:
    """Until a given-up load that reported at last has given back its L1 objects and pins:
    ``flush`` waits for the tasks of given-up requests too."""
    assert storage.flush(10)
    assert storage.l1.stats().write_locked == 0, "the given-up load's objects were never released"
    assert not any(each.pinned_keys() for each in storage.adapters), "its pins were never dropped"


def read_back(storage, keys, hits: int) -> None:
    objects = storage.read(keys[:hits])
    assert [o.key for o in objects] == keys[:hits]
    for obj in objects:
        assert bytes(storage.view(obj)) == payload(obj.key, SIZE)
    storage.release(keys[:hits])


def test_only_the_contiguous_prefix_is_loaded(engine) -> None:
    storage = engine([mock()])
    keys = keys_of(1, 5)
    store(storage, [keys[i] for i in (0, 1, 3, 4)], SIZE)
    assert storage.flush(10)
    storage.clear()

    handle = storage.submit_prefetch(keys)
    assert storage.wait_prefetch(handle, 10) == 2
    assert storage.status()["adapters"][0]["keys_loaded"] == 2
    assert [storage.l1.contains(k) for k in keys] == [True, True, False, False, False]
    read_back(storage, keys, 2)
    storage.release(keys[:2])  # the prefetch's own read lock
    assert len(storage.l1) == 0, "prefetched objects are temporary under the default policy"
    assert_no_locks(storage)


def test_hit_count_adds_l1_prefix_and_l2_prefix(engine, caplog) -> None:
    storage = engine([mock()])
    keys = keys_of(2, 6)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.l1.delete(keys[2:])
    with caplog.at_level(logging.DEBUG, logger="lmcache_tiers.controllers.prefetch"):
        handle = storage.submit_prefetch(keys)
        assert storage.wait_prefetch(handle, 10) == 6
    assert "Prefetch request submitted: 6 total keys, 2 L1 prefix hits, 4 remaining for L2" in caplog.text
    requests = storage.status()["requests"]
    assert (requests["l1_hit_chunks"], requests["l2_hit_chunks"]) == (2, 4)
    read_back(storage, keys, 6)
    storage.release(keys)
    assert_no_locks(storage)


def test_result_is_delivered_once(engine) -> None:
    storage = engine([mock()])
    keys = keys_of(3, 2)
    store(storage, keys, SIZE)
    handle = storage.submit_prefetch(keys)
    assert storage.wait_prefetch(handle, 10) == 2
    assert storage.query_prefetch(handle) == 0
    assert storage.query_prefetch(123456) == 0
    storage.release(keys)


def test_cascade_loads_each_key_from_the_lowest_index_adapter(engine) -> None:
    storage = engine([mock(), mock()])
    keys = keys_of(4, 5)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    assert storage.adapters[0].delete(keys[3:]) == [True, True]
    storage.clear()

    handle = storage.submit_prefetch(keys)
    assert storage.wait_prefetch(handle, 10) == 5
    first, second = storage.status()["adapters"]
    assert (first["keys_loaded"], second["keys_loaded"]) == (3, 2)
    read_back(storage, keys, 5)
    storage.release(keys)
    assert_no_locks(storage)


def test_default_frees_prefetched_objects_after_the_read(engine) -> None:
    storage = engine([mock()], l2_prefetch_policy="default")
    keys = keys_of(5, 3)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == 3
    assert storage.l1.stats().temporary == 3
    read_back(storage, keys, 3)
    storage.release(keys)
    assert len(storage.l1) == 0


def test_retain_keeps_prefetched_objects(engine) -> None:
    storage = engine([mock()], l2_prefetch_policy="retain")
    keys = keys_of(6, 3)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == 3
    read_back(storage, keys, 3)
    storage.release(keys)
    assert [storage.l1.contains(k) for k in keys] == [True] * 3
    assert storage.l1.stats().temporary == 0
    # A second lookup is served by L1 alone.
    assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == 3
    assert storage.status()["adapters"][0]["keys_loaded"] == 3
    storage.release(keys)
    assert_no_locks(storage)


def test_failed_load_ends_the_prefix_and_frees_everything_after_it(engine) -> None:
    storage = engine([gated()])
    keys = keys_of(7, 5)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    adapter(storage).fail_loads.add(keys[2])

    assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == 2
    assert [storage.l1.contains(k) for k in keys] == [True, True, False, False, False]
    assert storage.status()["failures"]["l2_load_failed"] == 1
    storage.release(keys[:2])
    assert len(storage.l1) == 0
    assert_no_locks(storage)


def test_requests_beyond_max_in_flight_queue(engine) -> None:
    storage = engine([gated()], l2_prefetch_max_in_flight=2)
    prompts = [keys_of(100 + p, 2) for p in range(5)]
    for keys in prompts:
        store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    gate = adapter(storage)
    gate.gate.clear()

    handles = [storage.submit_prefetch(keys) for keys in prompts]
    assert gate.loads_started.acquire(timeout=10)
    assert gate.loads_started.acquire(timeout=10)
    assert storage.status()["prefetch"]["in_flight"] == 2
    assert storage.status()["prefetch"]["queued"] == 3
    assert [storage.query_prefetch(h) for h in handles] == [None] * 5
    gate.gate.set()
    assert [storage.wait_prefetch(h, 10) for h in handles] == [2] * 5
    for keys in prompts:
        storage.release(keys)
    assert_no_locks(storage)


def test_overlapping_request_waits_for_the_one_loading_its_keys(engine) -> None:
    storage = engine([gated()])
    keys = keys_of(8, 4)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    gate = adapter(storage)
    gate.gate.clear()
    first = storage.submit_prefetch(keys)
    assert gate.loads_started.acquire(timeout=10)
    second = storage.submit_prefetch(keys, readers=2)
    assert storage.status()["prefetch"]["queued"] == 1
    gate.gate.set()
    assert storage.wait_prefetch(first, 10) == 4
    assert storage.wait_prefetch(second, 10) == 4
    assert storage.status()["adapters"][0]["keys_loaded"] == 4, "the second request loads nothing"
    assert storage.l1.stats().read_locks == 3 * 4
    storage.release(keys, 3)
    assert len(storage.l1) == 0
    assert_no_locks(storage)


def test_full_l1_loads_a_shorter_prefix(engine) -> None:
    big = 8 * MiB
    storage = engine([mock()])  # 64 MiB of L1
    pinned = keys_of(9, 6)
    wanted = keys_of(10, 4)
    store(storage, wanted, big)
    assert storage.flush(10)
    storage.clear()
    store(storage, pinned, big)
    assert storage.flush(10)
    held = storage.read(pinned)  # 48 MiB read-locked: not evictable
    assert len(held) == 6

    assert storage.wait_prefetch(storage.submit_prefetch(wanted), 10) == 2
    objects = storage.read(wanted[:2])
    assert all(bytes(storage.view(o)) == payload(o.key, big) for o in objects)
    storage.release(wanted[:2], 2)
    storage.release(pinned)
    assert all(storage.l1.contains(k) for k in pinned), "a locked object was evicted"
    assert_no_locks(storage)


def test_close_cancels_queued_requests_and_drains_running_ones(engine) -> None:
    storage = engine([gated()], l2_prefetch_max_in_flight=1)
    first_keys, second_keys = keys_of(11, 2), keys_of(12, 2)
    store(storage, first_keys + second_keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    gate = adapter(storage)
    gate.gate.clear()
    first = storage.submit_prefetch(first_keys)
    second = storage.submit_prefetch(second_keys)
    assert gate.loads_started.acquire(timeout=10)

    closer = threading.Thread(target=storage.close, kwargs={"drain_timeout_s": 30.0})
    closer.start()
    assert storage.wait_prefetch(second, 10) == 0, "a queued request is cancelled with no hits"
    gate.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert storage.query_prefetch(first) == 2


def test_a_prefetch_whose_load_never_reports_is_given_up_at_its_result_deadline(engine, caplog) -> None:
    # Results are kept half the lock TTL: 4 s here.
    storage = engine([gated()], l2_prefetch_max_in_flight=1, l1_lock_ttl_s=8.0)
    stuck_keys, later_keys = keys_of(15, 2), keys_of(16, 2)
    store(storage, stuck_keys + later_keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    backend = adapter(storage)
    hung = backend.gate
    hung.clear()
    stuck = storage.submit_prefetch(stuck_keys)
    assert backend.loads_started.acquire(timeout=10)
    # The first load stays parked (an adapter hung with no timeout of its own); later
    # loads go through.
    backend.gate = threading.Event()
    backend.gate.set()
    time.sleep(2.0)
    later = storage.submit_prefetch(later_keys)  # queued behind the only slot, 2 s to spare
    assert storage.status()["prefetch"]["queued"] == 1
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.controllers.prefetch"):
        assert storage.wait_prefetch(stuck, 10) == 0, "given up at its deadline, not still running"
        assert storage.wait_prefetch(later, 10) == 2, "the slot was freed for the queued request"
    failures = storage.status()["failures"]
    assert failures["prefetch_timed_out"] == 1
    assert "prefetch_result_expired" not in failures, "counted once, as given up"
    assert "still loading at their result deadline" in caplog.text
    read_back(storage, later_keys, 2)
    storage.release(later_keys)  # the prefetch's own read locks
    # The parked load still fills its L1 objects: they stay reserved until it reports, and
    # a new prefetch of those keys gets none of them -- a miss, counted.
    assert storage.l1.stats().write_locked == 2
    assert storage.wait_prefetch(storage.submit_prefetch(stuck_keys), 10) == 0
    assert storage.status()["failures"]["prefetch_key_being_written"] == 1
    hung.set()
    wait_given_up_loads_settled(storage)
    assert not any(storage.l1.contains(key) for key in stuck_keys)
    assert_no_locks(storage)


def test_submit_after_close_is_refused(engine) -> None:
    storage = engine([gated()])
    storage.close()
    with pytest.raises(Exception, match="closed"):
        storage.submit_prefetch(keys_of(13, 1))


@pytest.mark.parametrize("policy, hits", [("lying", 2), ("raising", 0)])
def test_a_misbehaving_policy_cannot_leak_locks(engine, policy: str, hits: int) -> None:
    storage = engine([mock(), mock()], l2_prefetch_policy=policy)
    keys = keys_of(14, 4)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    assert storage.adapters[0].delete(keys[2:]) == [True, True]  # adapter 0 lacks 2 and 3

    assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == hits
    read_back(storage, keys, hits)
    storage.release(keys[:hits])
    assert len(storage.l1) == 0
    assert_no_locks(storage)


def test_keys_planned_only_from_adapters_that_missed_them_end_the_prefix_counted(engine, caplog) -> None:
    # The lying policy plans every key from adapter 0, which lacks keys 2 and 3 (adapter 1
    # has them), and from adapter 7, which does not exist: the prefix ends at key 2, a miss
    # that fails closed, and both kinds of bad plan are counted and logged.
    storage = engine([mock(), mock()], l2_prefetch_policy="lying")
    keys = keys_of(40, 4)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    assert storage.adapters[0].delete(keys[2:]) == [True, True]

    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.controllers.prefetch"):
        assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == 2
    storage.release(keys[:2])
    failures = storage.stats.failures()
    assert failures.get("prefetch_policy_bad_adapter") == 4
    assert failures.get("prefetch_policy_planned_miss") == 2
    assert "prefetch_policy_planned_miss" in caplog.text
    assert_no_locks(storage)


def _one_flag_fewer(result: LookupResult) -> LookupResult:
    # the adapter pinned the hits it reports, but leaves the trailing miss out
    return LookupResult(list(result.found)[:-1], list(result.sizes)[:-1])


def _one_flag_more(result: LookupResult) -> LookupResult:
    return LookupResult([*result.found, result.found[0]], [*result.sizes, result.sizes[0]])


def _no_sizes(result: LookupResult) -> LookupResult:
    # the flags are right -- they name the pinned hits -- but the sizes are missing
    return LookupResult(list(result.found), None)  # type: ignore[arg-type]


@pytest.mark.parametrize("answered_now", [False, True], ids=["task", "now"])
@pytest.mark.parametrize(
    "malformed", [_one_flag_fewer, _one_flag_more, _no_sizes], ids=["fewer", "more", "no-sizes"]
)
def test_a_malformed_lookup_answer_leaves_no_pins(
    engine, malformed: Callable[[LookupResult], LookupResult], answered_now: bool
) -> None:
    storage = engine([AdapterSpec(type="gated_now" if answered_now else "gated", config=GatedConfig())])
    keys = keys_of(17, 4)
    store(storage, keys[:3], SIZE)  # the last key is a miss: the adapter does not pin it
    assert storage.flush(10)
    storage.clear()
    l2 = storage.adapters[0]
    if answered_now:
        look_up_now = l2.lookup_and_lock_now
        l2.lookup_and_lock_now = lambda keys: malformed(look_up_now(keys))
    else:
        pop = l2.pop_completed_lookups
        l2.pop_completed_lookups = lambda: {task: malformed(result) for task, result in pop().items()}
    assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == 0
    assert storage.status()["failures"]["l2_lookup_bad_result"] == 1
    assert_no_locks(storage)


@pytest.mark.parametrize("sizes", [None, [SIZE]], ids=["no-sizes", "too-few-sizes"])
def test_a_malformed_answer_to_a_given_up_lookup_is_counted_and_its_pins_dropped(engine, sizes) -> None:
    # A lookup still running when its request was given up settles as an orphan: its
    # answer is checked like any other (counted when malformed), and the pins it took go.
    from types import SimpleNamespace

    # Pinned with an immediate lookup: a task's answer would go to the controller thread.
    storage = engine([AdapterSpec(type="gated_now", config=GatedConfig())])
    keys = keys_of(19, 2)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    controller, slot = storage.prefetch, storage.prefetch.slots[0]
    pinned = slot.adapter.lookup_and_lock_now(keys)
    assert pinned is not None and pinned.found == [True, True]
    given_up = SimpleNamespace(remaining=keys)  # what the orphan path reads of its request
    controller._settle_orphan_lookup(slot, given_up, LookupResult([True, True], sizes))  # type: ignore[arg-type]
    assert storage.status()["failures"]["l2_lookup_bad_result"] == 1
    assert_no_locks(storage)


def test_a_loaded_result_given_back_never_drops_a_forgotten_lock(engine) -> None:
    # Lock deadlines fall on a grid of a 64th of the lock TTL: 31 ms here.
    step = 3 * 2.0 / 64
    storage = engine([mock()], l1_lock_ttl_s=2.0)
    keys = keys_of(17, 2)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    assert storage.evict(keys[1:]) == 1  # the first key in L1, the second in L2 only
    forgotten = storage.read(keys[:1])[0]  # its holder forgets it (never releases it)
    forgotten_deadline = forgotten.lock_deadline
    time.sleep(step)
    handle = storage.submit_prefetch(keys)  # an L1 hit, and a load from L2
    time.sleep(step)
    assert len(storage.read(keys[:1])) == 1  # a hot key: another reader's lock, still held
    storage.discard_prefetch(handle)  # its locks are given back, now or once it is done
    deadline = time.monotonic() + 10
    while storage.prefetch.busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not storage.prefetch.busy()
    storage.l1.expire_locks(forgotten_deadline)  # the forgotten lock expires
    assert forgotten.read_locks == 1, "a lock given back lives on in place of a forgotten one"
    storage.release(keys[:1])
    assert_no_locks(storage)


def test_a_request_given_up_never_drops_a_forgotten_lock(engine) -> None:
    # Results are kept half the lock TTL: 1 s here; lock deadlines fall on a grid of 31 ms.
    step = 3 * 2.0 / 64
    storage = engine([gated()], l1_lock_ttl_s=2.0)
    keys = keys_of(18, 2)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    assert storage.evict(keys[1:]) == 1  # the first key in L1, the second in L2 only
    backend = adapter(storage)
    backend.gate.clear()  # the load never reports (an adapter hung)
    forgotten = storage.read(keys[:1])[0]  # its holder forgets it (never releases it)
    forgotten_deadline = forgotten.lock_deadline
    time.sleep(step)
    handle = storage.submit_prefetch(keys)
    assert backend.loads_started.acquire(timeout=10)
    assert len(storage.read(keys[:1])) == 1  # a hot key: another reader's lock, still held
    assert storage.wait_prefetch(handle, 10) == 0  # given up at its result deadline
    storage.l1.expire_locks(forgotten_deadline)  # the forgotten lock expires
    assert forgotten.read_locks == 1, "a lock given back lives on in place of a forgotten one"
    storage.release(keys[:1])
    backend.gate.set()
    wait_given_up_loads_settled(storage)
    assert_no_locks(storage)
