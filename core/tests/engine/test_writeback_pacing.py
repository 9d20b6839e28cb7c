"""Write-back paced behind client work: slices, a bound in flight, deferral with its limits.

Every test reaches its state through conditions it waits for (counters, keys in the
adapter), never through sleeps; deferral is made long (a minute) where a test needs it to
hold, so no assertion depends on how fast the machine is.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from engine_support import GatedConfig, gated_backend, keys_of, store, wait_for

from lmcache_tiers.activity import DATA_PLANE
from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.controllers import store_pacing
from lmcache_tiers.l2.background import WRITE_BACK, get_ioprio, ioprio_value
from lmcache_tiers.storage import StorageManager

SIZE = 32 * 1024


def gated() -> AdapterSpec:
    return AdapterSpec(type="gated", config=GatedConfig())


def stored_keys(storage: StorageManager) -> set[object]:
    return set(storage.adapters[0].iter_keys())


@pytest.fixture
def client_busy() -> Iterator[None]:
    """A client copy in progress for as long as the test runs."""
    token = object()
    DATA_PLANE.begin(token)
    try:
        yield
    finally:
        DATA_PLANE.end(token)


@pytest.fixture
def long_deferral(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_pacing, "MAX_DEFER_S", 60.0)
    monkeypatch.setattr(DATA_PLANE, "stale_s", 120.0)


def test_write_back_waits_while_a_client_is_busy(engine, long_deferral, client_busy) -> None:
    storage = engine([gated()])
    keys = keys_of(1, 4)
    store(storage, keys, SIZE)
    assert wait_for(lambda: storage.store.deferrals() > 0), "the controller never looked at the batch"
    assert stored_keys(storage) == set()
    assert storage.store.pending_batches() == 1, "one slice waits"
    assert all(storage.l1.get(key).unstored for key in keys), "waiting objects stay protected"


def test_write_back_goes_once_the_data_plane_is_quiet(engine, long_deferral) -> None:
    storage = engine([gated()])
    token = object()
    DATA_PLANE.begin(token)
    keys = keys_of(2, 4)
    try:
        store(storage, keys, SIZE)
        assert wait_for(lambda: storage.store.deferrals() > 0)
        assert stored_keys(storage) == set()
    finally:
        DATA_PLANE.end(token)
    assert wait_for(lambda: stored_keys(storage) == set(keys)), "write-back never resumed"
    assert storage.flush(10)


def test_a_flush_does_not_wait_for_quiet(engine, long_deferral, client_busy) -> None:
    storage = engine([gated()])
    keys = keys_of(3, 4)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    assert stored_keys(storage) == set(keys)


def test_deferral_ends_at_its_deadline(engine, monkeypatch, client_busy) -> None:
    monkeypatch.setattr(store_pacing, "MAX_DEFER_S", 0.05)
    monkeypatch.setattr(DATA_PLANE, "stale_s", 120.0)
    storage = engine([gated()])
    keys = keys_of(4, 4)
    store(storage, keys, SIZE)
    # Nobody flushes and the client never stops: the deadline alone gets them to L2.
    assert wait_for(lambda: stored_keys(storage) == set(keys))


def test_a_lost_end_stops_holding_write_back_back(engine, long_deferral, monkeypatch) -> None:
    monkeypatch.setattr(DATA_PLANE, "stale_s", 0.05)
    DATA_PLANE.begin(object())  # never ended: a client that died between reserve and commit
    storage = engine([gated()])
    keys = keys_of(5, 4)
    store(storage, keys, SIZE)
    assert wait_for(lambda: stored_keys(storage) == set(keys))


def test_pressure_on_l1_ends_deferral(engine, long_deferral, monkeypatch, client_busy) -> None:
    # Objects stored in no adapter yet holding more than this share of L1 go at once.
    monkeypatch.setattr(store_pacing, "PRESSURE_FRACTION", 3 * SIZE / (64 << 20))
    storage = engine([gated()])
    few = keys_of(6, 2)
    store(storage, few, SIZE)
    assert wait_for(lambda: storage.store.deferrals() > 0)
    assert stored_keys(storage) == set()
    more = keys_of(7, 2)
    store(storage, more, SIZE)  # 4 objects stored nowhere: over the threshold
    assert wait_for(lambda: stored_keys(storage) == set(few + more))
    # The adapter holds a key a moment before its completion reaches L1.
    assert wait_for(lambda: storage.l1.unstored_bytes == 0)
    # Stored, they press no more: the next write waits for quiet again.
    deferred = storage.store.deferrals()
    later = keys_of(13, 1)
    store(storage, later, SIZE)
    assert wait_for(lambda: storage.store.deferrals() > deferred)
    assert stored_keys(storage) == set(few + more)


def test_pressure_ends_once_one_adapter_stored_everything(engine, long_deferral, monkeypatch) -> None:
    # The default store policy sends every key to both adapters; the second is parked.  An
    # object the first stored is evictable at no loss, so the second's backlog of them
    # must not keep write-back pressed (no deferral, threads hurried) behind it.
    monkeypatch.setattr(store_pacing, "PRESSURE_FRACTION", 3 * SIZE / (64 << 20))
    monkeypatch.setattr(store_pacing, "SLICE_BYTES", SIZE)
    monkeypatch.setattr(store_pacing, "INFLIGHT_BYTES", SIZE)
    storage = engine([gated(), gated()])
    gated_backend(storage, 1).store_gate.clear()
    first = keys_of(20, 4)
    store(storage, first, SIZE)  # the data plane is quiet: the first adapter takes them all
    assert wait_for(lambda: stored_keys(storage) == set(first))
    assert wait_for(lambda: not any(storage.l1.get(key).unstored for key in first))
    assert storage.l1.unstored_bytes == 0
    assert storage.store.pending_batches() == 3, "the parked adapter has one in flight, three waiting"
    token = object()
    DATA_PLANE.begin(token)
    try:
        deferred = storage.store.deferrals()
        later = keys_of(21, 1)
        store(storage, later, SIZE)
        assert wait_for(lambda: storage.store.deferrals() > deferred), (
            "write-back stayed pressed by a slow adapter's slices of objects stored elsewhere"
        )
        assert stored_keys(storage) == set(first)
    finally:
        DATA_PLANE.end(token)
    gated_backend(storage, 1).store_gate.set()
    assert storage.flush(10)
    assert set(storage.adapters[1].iter_keys()) == set(first + later)


def test_batches_are_cut_into_slices_and_few_are_in_flight(engine, monkeypatch) -> None:
    monkeypatch.setattr(store_pacing, "SLICE_BYTES", 2 * SIZE)
    monkeypatch.setattr(store_pacing, "INFLIGHT_BYTES", 4 * SIZE)
    storage = engine([gated()])
    backend = gated_backend(storage)
    backend.store_gate.clear()
    keys = keys_of(8, 10)  # 5 slices of 2 objects
    store(storage, keys, SIZE)
    adapter_status: Callable[[], dict[str, int]] = lambda: storage.status()["adapters"][0]  # noqa: E731
    # Two slices fill the bound in flight; the other three wait in the controller.
    assert wait_for(lambda: adapter_status()["store_tasks_submitted"] == 2)
    assert storage.store.in_flight() == 2
    assert storage.store.pending_batches() == 3
    assert storage.l1.stats().read_locks == 4, "only the objects handed to the adapter are read-locked"
    backend.store_gate.set()
    assert storage.flush(10)
    status = adapter_status()
    counts = status["store_tasks_submitted"], status["store_tasks_completed"], status["keys_stored"]
    assert counts == (5, 5, 10)
    assert stored_keys(storage) == set(keys)
    assert all(not obj.unstored for obj in (storage.l1.get(key) for key in keys) if obj is not None)
    assert storage.l1.stats().read_locks == 0


def test_one_object_larger_than_a_slice_is_a_slice_of_its_own(engine, monkeypatch) -> None:
    monkeypatch.setattr(store_pacing, "SLICE_BYTES", SIZE // 2)
    monkeypatch.setattr(store_pacing, "INFLIGHT_BYTES", SIZE // 2)
    storage = engine([gated()])
    keys = keys_of(9, 3)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    status = storage.status()["adapters"][0]
    assert (status["store_tasks_submitted"], status["keys_stored"]) == (3, 3)


def one_store_running_two_queued(engine, monkeypatch, first_key: int) -> tuple[StorageManager, Any]:
    """Three one-slice writes behind a parked store: one running, two slices waiting."""
    monkeypatch.setattr(store_pacing, "SLICE_BYTES", SIZE)
    monkeypatch.setattr(store_pacing, "INFLIGHT_BYTES", SIZE)
    storage = engine([gated()])
    backend = gated_backend(storage)
    backend.store_gate.clear()
    store(storage, keys_of(first_key, 3), SIZE)
    assert wait_for(lambda: storage.store.in_flight() == 1 and storage.store.pending_batches() == 2)
    return storage, backend


def close_giving_up(storage: StorageManager, *backends: Any) -> dict[str, int]:
    """Close with a drain that gives up on the parked stores; the failure counters then.

    The adapters' close waits for the parked calls, which timers let go."""
    openers = [threading.Timer(0.5, backend.store_gate.set) for backend in backends]
    for opener in openers:
        opener.start()
    storage.close(drain_timeout_s=0.05)
    for opener in openers:
        opener.join()
    return storage.stats.failures()


def test_slices_never_submitted_are_counted_as_dropped_at_shutdown(engine, monkeypatch) -> None:
    storage, backend = one_store_running_two_queued(engine, monkeypatch, 10)
    failures = close_giving_up(storage, backend)
    assert failures.get("l2_store_abandoned") == 1
    assert failures.get("l2_store_dropped_at_shutdown") == 2


def test_writes_counted_lost_when_l1_dropped_them_are_not_counted_again_at_shutdown(
    engine, monkeypatch
) -> None:
    # A clear that removes objects before their store counts each acknowledged write lost
    # once; the slices still queued for them at shutdown lose nothing more.
    storage, backend = one_store_running_two_queued(engine, monkeypatch, 15)
    storage.clear()  # the two queued objects go; the one being stored is locked
    failures = close_giving_up(storage, backend)
    assert failures.get("l1_cleared_before_l2_store") == 2
    assert failures.get("l2_store_abandoned") == 1
    assert "l2_store_dropped_at_shutdown" not in failures


def test_keys_gone_before_two_adapters_stores_count_for_each_at_shutdown(engine, monkeypatch) -> None:
    # A key that left L1 before its stores counts as skipped once per adapter it was meant
    # for, as a running controller counts it when it finds the key gone: so too for the
    # slices a drain gives up on.
    monkeypatch.setattr(store_pacing, "SLICE_BYTES", SIZE)
    monkeypatch.setattr(store_pacing, "INFLIGHT_BYTES", SIZE)
    storage = engine([gated(), gated()])
    backends = [gated_backend(storage, index) for index in range(2)]
    for backend in backends:
        backend.store_gate.clear()
    store(storage, keys_of(17, 3), SIZE)
    assert wait_for(lambda: storage.store.in_flight() == 2 and storage.store.pending_batches() == 4)
    storage.clear()  # the two queued objects go; the one being stored is locked
    failures = close_giving_up(storage, *backends)
    assert failures.get("l1_cleared_before_l2_store") == 2
    assert storage.stats.get("l2_store_skipped_gone") == 2 * 2


def test_a_write_evicted_as_the_drain_settles_it_is_still_counted_lost(engine, monkeypatch) -> None:
    # The drain gives up on an object's store and clears its unstored flag: an eviction
    # then (the eviction controller runs on) takes it as any stored object, uncounted, so
    # the drain must not count it as gone -- the acknowledged write was lost right there.
    storage, backend = one_store_running_two_queued(engine, monkeypatch, 16)
    l1 = storage.l1
    settle = l1.settle_unstored

    def settle_then_evict(objs) -> None:
        objs = list(objs)
        settle(objs)
        l1.evict(l1.capacity_bytes, [obj.key for obj in objs])  # an eviction right after

    monkeypatch.setattr(l1, "settle_unstored", settle_then_evict)
    failures = close_giving_up(storage, backend)
    assert failures.get("l2_store_abandoned") == 1
    assert failures.get("l2_store_dropped_at_shutdown") == 2


class RoutedStorePolicy:
    """Each key to the one adapter ``routes`` names."""

    def __init__(self, routes: dict[object, int]) -> None:
        self.routes = routes

    def select_store_targets(self, keys: list[Any], adapters: Any) -> dict[int, list[Any]]:
        plan: dict[int, list[Any]] = {}
        for key in keys:
            plan.setdefault(self.routes[key], []).append(key)
        return plan

    def select_l1_deletions(self, keys: list[Any]) -> list[Any]:
        return []


@pytest.mark.parametrize("outcome", ["stored", "failed"])
def test_a_finished_slice_of_a_batch_still_waiting_at_shutdown_is_settled(
    engine, monkeypatch, outcome: str
) -> None:
    # A batch's first key is done in adapter 1 (stored, or failed and counted so) while its
    # second waits behind a store parked in adapter 0, and the drain gives up: the first
    # must not stay flagged as L1's only copy of a write, or an eviction in the last
    # moments counts it lost -- once more, or although L2 holds it.
    monkeypatch.setattr(store_pacing, "SLICE_BYTES", SIZE)
    monkeypatch.setattr(store_pacing, "INFLIGHT_BYTES", SIZE)
    storage = engine([gated(), gated()])
    parked, other = gated_backend(storage, 0), gated_backend(storage, 1)
    (running,), (done, waiting) = keys_of(17, 1), keys_of(18, 2)
    monkeypatch.setattr(storage.store, "policy", RoutedStorePolicy({running: 0, done: 1, waiting: 0}))
    parked.store_gate.clear()
    if outcome == "failed":
        other.fail_stores.add(done)
    store(storage, [running], SIZE)
    assert wait_for(lambda: storage.store.in_flight() == 1)
    store(storage, [done, waiting], SIZE)
    status: Callable[[], dict[str, int]] = lambda: storage.status()["adapters"][1]  # noqa: E731
    assert wait_for(lambda: status()["store_tasks_completed"] == 1 and storage.store.pending_batches() == 1)
    assert storage.store.stop(drain_timeout_s=0.05)
    assert not storage.l1.get(done).unstored
    storage.l1_eviction.evict_now(storage.l1.capacity_bytes)
    failures = storage.stats.failures()
    assert "evicted_before_l2_store" not in failures
    assert failures.get("l2_store_abandoned") == 1
    assert failures.get("l2_store_dropped_at_shutdown") == 1
    assert failures.get("l2_store_failed", 0) == (1 if outcome == "failed" else 0)


@pytest.mark.parametrize("other_stored", [True, False], ids=["stored-elsewhere", "stored-nowhere"])
def test_an_abandoned_object_is_counted_once_and_only_when_no_adapter_stored_it(
    engine, other_stored: bool
) -> None:
    # Every key goes to both adapters: the stop summary says how many acknowledged objects
    # are missing from L2, which is not one per adapter's task.
    storage = engine([gated(), gated()])
    first, second = gated_backend(storage, 0), gated_backend(storage, 1)
    second.store_gate.clear()
    if not other_stored:
        first.store_gate.clear()
    keys = keys_of(14, 2)
    store(storage, keys, SIZE)
    if other_stored:
        assert wait_for(lambda: stored_keys(storage) == set(keys) and storage.store.in_flight() == 1)
    else:
        assert wait_for(lambda: storage.store.in_flight() == 2)
    opener = threading.Timer(0.5, lambda: (first.store_gate.set(), second.store_gate.set()))
    opener.start()
    storage.close(drain_timeout_s=0.05)
    opener.join()
    failures = storage.stats.failures()
    assert failures.get("l2_store_abandoned", 0) == (0 if other_stored else len(keys))
    assert "l2_store_dropped_at_shutdown" not in failures


def test_writes_committed_after_the_store_controller_stopped_are_counted_as_dropped(engine) -> None:
    # A commit that passed the open check while shutdown began reaches the controller
    # after it drained and ended: nothing will store it, so it is counted, not queued.
    storage = engine([gated()])
    storage.store.stop()
    keys = keys_of(13, 2)
    store(storage, keys, SIZE)
    assert storage.stats.failures().get("l2_store_dropped_at_shutdown") == 2
    assert storage.store.pending_batches() == 0
    assert not any(obj.unstored for obj in (storage.l1.get(key) for key in keys) if obj is not None)


def test_no_deferral_after_l1_lost_an_object_before_its_store(engine, long_deferral, client_busy) -> None:
    storage = engine([gated()])
    early = keys_of(11, 2)
    store(storage, early, SIZE)
    assert wait_for(lambda: storage.store.deferrals() > 0)
    assert stored_keys(storage) == set()
    # L1 had to take an object before its L2 store: it is short of room, so nothing more
    # waits for quiet (the waiting slice goes at the controller's next look).
    storage.stats.fail("evicted_before_l2_store")
    later = keys_of(12, 2)
    store(storage, later, SIZE)
    assert wait_for(lambda: stored_keys(storage) == set(early + later))


@pytest.mark.skipif(
    not WRITE_BACK.uses_idle, reason="this process may not leave SCHED_IDLE (needs CAP_SYS_NICE)"
)
def test_a_flush_hurries_idle_write_back_threads_until_they_are_done(engine, new_threads) -> None:
    storage = engine([gated()])
    backend = gated_backend(storage)
    backend.store_gate.clear()
    store(storage, keys_of(9, 2), SIZE)
    assert wait_for(lambda: storage.store.in_flight() == 1)
    stores = [t.native_id for t in new_threads("l2-") if "-store-" in t.name]
    assert stores
    # A store task waiting on I/O (here: the gate) for two starvation windows is not
    # starved -- its thread waits asleep, not for a core: still idle.
    time.sleep(2 * store_pacing.STARVE_WINDOW_S + 0.05)
    assert not WRITE_BACK.hurried
    assert {get_ioprio(tid) for tid in stores} == {ioprio_value(idle=True)}
    flushed: list[bool] = []
    flusher = threading.Thread(target=lambda: flushed.append(storage.flush(10)))
    flusher.start()
    try:
        assert wait_for(lambda: WRITE_BACK.hurried)
        assert {get_ioprio(tid) for tid in stores} == {ioprio_value(idle=False)}
        assert os.SCHED_IDLE not in {os.sched_getscheduler(tid) for tid in stores}
    finally:
        backend.store_gate.set()
        flusher.join(20)
    assert flushed == [True]
    assert wait_for(lambda: not WRITE_BACK.hurried)


@pytest.mark.parametrize(
    ("ran", "waited", "starved"),
    [
        (0.165, 0.087, False),  # idle beside requests: waits a third, runs two thirds of a core
        (0.060, 0.190, False),  # waits most of the window, still more than nice 10's share
        (0.005, 0.240, True),  # every core busy elsewhere: next to nothing
        (0.001, 0.010, False),  # asleep on I/O: neither runs nor waits for a core
    ],
)
def test_write_back_threads_are_starved_only_when_idle_gives_less_than_nice_10(
    ran: float, waited: float, starved: bool
) -> None:
    assert store_pacing.starved(ran, waited, store_pacing.STARVE_WINDOW_S) is starved
