"""A store that meets an L2 eviction deleting its key in the same adapter is refused there
(``store_skipped_deleting``); the store controller stores the key again, once, after the
delete ended, while L1 still holds the object (an acknowledged write: with its store only
failed, its batch would end and an L1 eviction would drop it uncounted).

The backend's delete waits at a gate (a threading event) the test opens, so the delete is
provably running when the store arrives; nothing is timed.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Sequence

import pytest
from engine_support import GatedConfig, gated_backend, keys_of, store, store_in_l2_only, wait_for

from lmcache_tiers.config import AdapterSpec, L2EvictionConfig
from lmcache_tiers.controllers import l2_deletes, l2_eviction
from lmcache_tiers.controllers.l2_deletes import L2Deletes
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.storage import StorageManager

SIZE = 32 * 1024


def evicting_adapter() -> AdapterSpec:
    # Eviction only when the test asks for it (``evict``): the watermark is never reached.
    eviction = L2EvictionConfig(trigger_watermark=0.99, eviction_ratio=0.5)
    return AdapterSpec(type="gated", config=GatedConfig(capacity_mb=8, eviction=eviction))


class ParkedDeletes:
    """The backend's deletes wait at a gate until the test opens it."""

    def __init__(self, storage: StorageManager, monkeypatch: pytest.MonkeyPatch) -> None:
        backend = gated_backend(storage)
        self.arrived = threading.Event()
        self.gate = threading.Event()
        delete_many = backend.delete_many

        def parked(keys: Sequence[ObjectKey]) -> list[bool]:
            self.arrived.set()
            assert self.gate.wait(30)
            return delete_many(keys)

        monkeypatch.setattr(backend, "delete_many", parked)


def evict_in_background(storage: StorageManager, *, delete_deadline_s: float = 60.0) -> threading.Thread:
    """An eviction of ``SIZE`` bytes on a thread of its own, whose delete is taken for hung
    once ``delete_deadline_s`` passed (by default the parked delete is no hang)."""
    controller = storage.l2_evictions[0]
    controller.delete_deadline_s = delete_deadline_s
    thread = threading.Thread(target=controller.evict, args=(SIZE,), daemon=True)
    thread.start()
    return thread


def let_go(deletes: ParkedDeletes, evicting: threading.Thread) -> None:
    """Open the gate of the parked deletes and wait for the eviction and for each delete's
    own thread (an eviction whose wait was cut short, by a close or by its deadline, left
    it running)."""
    deletes.gate.set()
    evicting.join(30)
    for thread in threading.enumerate():
        if thread.name.endswith("-delete"):
            thread.join(30)


def test_a_store_refused_by_a_running_delete_is_stored_again_once_it_ended(engine, monkeypatch) -> None:
    storage = engine([evicting_adapter()])
    (key,) = keys_of(1, 1)
    store_in_l2_only(storage, [key], SIZE)  # L2's copy, the eviction's first victim
    # Older than the key once it is stored again: the victims should the eviction find that
    # its delete freed nothing (the store again may land before it looks).
    store_in_l2_only(storage, keys_of(2, 4), SIZE)
    deletes = ParkedDeletes(storage, monkeypatch)
    evicting = evict_in_background(storage)
    try:
        assert deletes.arrived.wait(10), "the eviction never deleted the key"
        assert store(storage, [key], SIZE) == [key]  # written again while L2 deletes it
        # The store met the delete and was refused; the key waits for the delete to end.
        assert wait_for(lambda: storage.adapters[0].stats().get("store_skipped_deleting") == 1)
        assert wait_for(lambda: storage.stats.failures().get("l2_store_retried_after_delete") == 1), (
            "a store refused by a running delete was not queued again"
        )
        assert storage.l1.get(key).unstored, "stored nowhere meanwhile: still protected in L1"
    finally:
        let_go(deletes, evicting)
    assert storage.flush(10)
    assert key in set(storage.adapters[0].iter_keys()), "the acknowledged write is in no L2"
    assert not storage.l1.get(key).unstored
    failures = storage.stats.failures()
    assert "l2_store_failed" not in failures
    assert failures.get("l2_store_retried_after_delete") == 1


def test_deletes_are_remembered_for_the_stores_that_may_have_met_them() -> None:
    deletes = L2Deletes()
    first, second, third = keys_of(3, 3)
    before = deletes.events  # a store submitted now
    deletes.begin([first, second])
    assert deletes.raced([first, third], before) == [first]  # running
    deletes.end([first, second])
    assert not deletes.running([first, second])
    assert deletes.raced([first, second, third], before) == [first, second]  # ended since
    after = deletes.events  # a store submitted after those ended met none of them
    assert deletes.raced([first, second], after) == []
    deletes.forget_before(after)  # no store older than that is running
    assert deletes.raced([first, second], before) == []


def test_the_oldest_ended_deletes_are_forgotten_first(monkeypatch) -> None:
    monkeypatch.setattr(l2_deletes, "ENDED_MAX", 2)
    deletes = L2Deletes()
    first, second, third = keys_of(4, 3)
    before = deletes.events
    for key in (first, second, first):  # ``first`` ended again: now the newest
        deletes.begin([key])
        deletes.end([key])
    assert deletes.raced([first, second], before) == [first, second]
    deletes.begin([third])
    deletes.end([third])  # one over the bound: the oldest (``second``) goes
    assert deletes.raced([first, second, third], before) == [first, third]
    since_first = deletes.events - 2  # ``first`` ended at that count, ``third`` after
    deletes.forget_before(since_first)
    assert deletes.raced([first, third], before) == [third]


def test_a_store_waiting_for_a_delete_that_never_ends_is_counted_at_the_stop(engine, monkeypatch) -> None:
    storage = engine([evicting_adapter()])
    (key,) = keys_of(5, 1)
    store_in_l2_only(storage, [key], SIZE)
    deletes = ParkedDeletes(storage, monkeypatch)
    evicting = evict_in_background(storage)
    try:
        assert deletes.arrived.wait(10), "the eviction never deleted the key"
        assert store(storage, [key], SIZE) == [key]
        assert wait_for(lambda: storage.stats.failures().get("l2_store_retried_after_delete") == 1)
        assert not storage.flush(0.2), "a flush reported done while the key is in no L2"
        assert storage.l1.get(key).unstored
        storage.close(drain_timeout_s=0.0)  # the delete is still parked
        failures = storage.stats.failures()
        assert failures.get("l2_store_dropped_at_shutdown") == 1, failures
        assert "l2_store_failed" not in failures
    finally:
        let_go(deletes, evicting)  # the close cut the eviction's wait short


def test_a_store_waiting_for_a_delete_past_its_deadline_is_given_up_and_the_flush_ends(
    engine, monkeypatch
) -> None:
    storage = engine([evicting_adapter()])
    (key,) = keys_of(7, 1)
    store_in_l2_only(storage, [key], SIZE)
    deletes = ParkedDeletes(storage, monkeypatch)
    # Past its deadline before or after the store meets it: the key is given up either way.
    evicting = evict_in_background(storage, delete_deadline_s=0.01)
    try:
        assert deletes.arrived.wait(10), "the eviction never deleted the key"
        assert store(storage, [key], SIZE) == [key]
        assert wait_for(lambda: storage.stats.failures().get("l2_store_retried_after_delete") == 1)
        # The delete is still parked: the flush ends without it, the key given up and counted.
        assert storage.flush(10), "a flush waited for a store behind a delete past its deadline"
        failures = storage.stats.failures()
        assert failures.get("l2_eviction_delete_timeout") == 1, failures
        assert failures.get("l2_store_given_up_delete_hung") == 1, failures
        assert storage.adapters[0].stats().get("store_skipped_deleting") == 1
        assert storage.stats.adapter(0).get("keys_store_failed") == 1
        obj = storage.l1.get(key)
        assert obj is not None and not obj.unstored, "the given-up key is L1's, settled"
        assert "l2_store_failed" not in failures
    finally:
        let_go(deletes, evicting)
    assert storage.flush(10)
    assert storage.stats.failures().get("l2_store_given_up_delete_hung") == 1, "given up once"


def test_a_delete_whose_thread_starts_after_its_deadline_is_still_past_it(engine, monkeypatch) -> None:
    # On a loaded machine the delete's own thread may not run before the eviction's wait
    # ends: its keys must be running by then, or the deadline marks nothing and the store
    # waiting for that delete waits until the drain deadline after all.
    storage = engine([evicting_adapter()])
    (key,) = keys_of(10, 1)
    store_in_l2_only(storage, [key], SIZE)
    deletes = ParkedDeletes(storage, monkeypatch)
    runs = threading.Event()

    class LateDeleteThread(threading.Thread):
        def run(self) -> None:
            if self.name.endswith("-delete"):
                assert runs.wait(30)
            super().run()

    monkeypatch.setattr(
        l2_eviction, "threading", types.SimpleNamespace(**{**vars(threading), "Thread": LateDeleteThread})
    )
    evicting = evict_in_background(storage, delete_deadline_s=0.01)
    try:
        evicting.join(30)  # its wait ended, the delete's thread not run yet
        assert not evicting.is_alive()
        assert storage.stats.failures().get("l2_eviction_delete_timeout") == 1
        runs.set()
        assert deletes.arrived.wait(10), "the eviction never deleted the key"
        assert store(storage, [key], SIZE) == [key]
        assert storage.flush(10), "a store waited for a delete that was past its deadline"
        assert storage.stats.failures().get("l2_store_given_up_delete_hung") == 1
    finally:
        runs.set()
        let_go(deletes, evicting)


class FirstStoreParked:
    """The backend's first store waits at a gate the test opens, then fails every key;
    the stores after it go through."""

    def __init__(self, storage: StorageManager, monkeypatch: pytest.MonkeyPatch) -> None:
        backend = gated_backend(storage)
        self.arrived = threading.Event()
        self.gate = threading.Event()
        put_many = backend.put_many

        def parked(keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
            if self.arrived.is_set():
                return put_many(keys, payloads)
            self.arrived.set()
            assert self.gate.wait(30)
            return [False] * len(keys)

        monkeypatch.setattr(backend, "put_many", parked)


def test_the_keys_of_a_slice_behind_no_running_delete_are_stored_once_the_hung_ones_are_given_up(
    engine, monkeypatch
) -> None:
    # One store task meets two deletes of its adapter: one of ``ended`` that ran while the
    # task did (its store failed), and one of ``hung``, past its deadline, that refused
    # ``hung``.  Both are stored again in one slice; once ``hung`` is given up, ``ended``
    # waits for no delete, and no delete's end will wake the controller for it.
    storage = engine([evicting_adapter()])
    ended, hung = keys_of(9, 2)
    store_in_l2_only(storage, [hung], SIZE)
    storage.store.interval_s = 3600.0  # only wake-ups move it
    deletes = ParkedDeletes(storage, monkeypatch)
    evicting = evict_in_background(storage, delete_deadline_s=0.01)
    stores = FirstStoreParked(storage, monkeypatch)
    try:
        assert deletes.arrived.wait(10), "the eviction never deleted ``hung``"
        assert wait_for(lambda: storage.stats.failures().get("l2_eviction_delete_timeout") == 1)
        assert store(storage, [ended, hung], SIZE) == [ended, hung]
        assert stores.arrived.wait(10), "the store of ``ended`` never reached the backend"
        slot_deletes = storage.l2_evictions[0].slot.deletes
        slot_deletes.begin([ended])  # a delete of ``ended`` ran while the store did
        slot_deletes.end([ended])
        stores.gate.set()
        assert storage.flush(10), "a key behind no running delete waited for a wake-up"
        assert ended in set(storage.adapters[0].iter_keys()), "the acknowledged write is in no L2"
        failures = storage.stats.failures()
        assert failures.get("l2_store_retried_after_delete") == 2, failures
        assert failures.get("l2_store_given_up_delete_hung") == 1, failures
        assert "l2_store_failed" not in failures
    finally:
        stores.gate.set()
        let_go(deletes, evicting)


def test_only_the_keys_of_an_overdue_delete_are_hung() -> None:
    deletes = L2Deletes()
    first, second, third = keys_of(8, 3)
    deletes.begin([first])
    deletes.begin([second])
    deletes.overdue([second, third])  # ``third``'s delete is not running: nothing to mark
    assert deletes.hung([first, second, third]) == [second]
    deletes.end([second])
    assert deletes.hung([second]) == []
    deletes.begin([second])  # a new delete of it is not overdue
    assert deletes.hung([first, second]) == []


def test_deletes_no_store_met_are_forgotten_though_the_adapter_stores_nothing(engine) -> None:
    # Its store completions never wake the controller: the ended deletes are forgotten at
    # the wake-up their end brings, not kept (up to ENDED_MAX keys) for stores never made.
    storage = engine([evicting_adapter()])
    victims = keys_of(6, 4)
    store_in_l2_only(storage, victims, SIZE)
    deletes = storage.l2_evictions[0].slot.deletes
    assert storage.l2_evictions[0].evict(SIZE) > 0
    assert wait_for(lambda: deletes.raced(victims, -1) == []), "ended deletes kept for no store"
