"""Store slices that never become tasks: they hold back no slice behind them, do not pile
up for a slow adapter, and a burst of them is one log line.

A slice whose objects all left L1 before their store (a clear, an eviction under
pressure) ends as soon as it is taken: no task runs, so no adapter report wakes the store
controller for the next one.  The controller's regular interval is made an hour in the
first test, so a slice queued behind such one reaches L2 only if the step that took it
goes on to take the next -- no assertion depends on how fast the machine is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from engine_support import GatedConfig, gated_backend, keys_of, store, wait_for

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.controllers import store_pacing
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.storage import StorageManager

SIZE = 32 * 1024
L1_BYTES = 1 << 20
PER_WRITE = 4  # objects of one write: one slice
BOUND = 2 * L1_BYTES // (PER_WRITE * SIZE)  # slices of twice L1's bytes


def behind_a_slow_adapter(
    engine: Callable[..., StorageManager], monkeypatch: pytest.MonkeyPatch, **settings: Any
) -> StorageManager:
    """A small L1 and two adapters (the default policy sends every key to both), the
    second parked: its slices wait, one in flight at a time."""
    monkeypatch.setattr(store_pacing, "INFLIGHT_BYTES", SIZE)
    storage = engine(
        [AdapterSpec(type="gated", config=GatedConfig()), AdapterSpec(type="gated", config=GatedConfig())],
        l1_gb=L1_BYTES / (1 << 30),
        **settings,
    )
    gated_backend(storage, 1).store_gate.clear()
    return storage


def write_stored_by_the_first(storage: StorageManager, prompt: int) -> list[ObjectKey]:
    """A write of ``PER_WRITE`` objects, once the first adapter stored it (settled in L1:
    a clear or an eviction of it loses nothing)."""
    keys = keys_of(prompt, PER_WRITE)
    store(storage, keys, SIZE)
    assert wait_for(lambda: not any(storage.l1.get(key).unstored for key in keys))
    return keys


def test_a_write_queued_behind_slices_of_cleared_objects_is_stored(engine, monkeypatch) -> None:
    monkeypatch.setattr(store_pacing, "SLICE_BYTES", SIZE)
    monkeypatch.setattr(store_pacing, "INFLIGHT_BYTES", SIZE)  # one slice in flight at a time
    storage = engine([AdapterSpec(type="gated", config=GatedConfig())])
    storage.store.interval_s = 3600.0  # only wake-ups move it: adapter reports and commits
    backend = gated_backend(storage)
    backend.store_gate.clear()
    first, *cleared = keys_of(1, 3)
    store(storage, [first, *cleared], SIZE)  # one slice per object: one parked, two waiting
    assert wait_for(lambda: storage.store.in_flight() == 1 and storage.store.pending_batches() == 2)
    assert storage.clear() == 2  # the waiting ones go (counted); the one being stored is locked
    later = keys_of(2, 1)
    store(storage, later, SIZE)  # queued behind the two slices of cleared objects
    assert wait_for(lambda: storage.store.pending_batches() == 3)
    backend.store_gate.set()
    # The parked store's report wakes the controller once: the slices of cleared objects
    # end without a task, and the later write's slice must go in that same step.
    assert wait_for(lambda: set(storage.adapters[0].iter_keys()) == {first, *later}), (
        "the write queued behind slices of cleared objects waited for a wake-up that never came"
    )
    assert storage.store.pending_batches() == 0
    failures = storage.stats.failures()
    assert failures.get("l1_cleared_before_l2_store") == 2
    assert storage.stats.get("l2_store_skipped_gone") == 2


def test_slices_for_a_slow_adapter_whose_objects_left_l1_do_not_pile_up(engine, monkeypatch) -> None:
    # The default store policy sends every key to every adapter.  The second adapter here
    # takes nothing (its store is parked); the first stores each write, which L1 then
    # drops.  The second's waiting slices name objects no tier will ever store from L1,
    # and writes would queue them for as long as it stays slower than the writes.
    storage = behind_a_slow_adapter(engine, monkeypatch)
    writes = 3 * L1_BYTES // (PER_WRITE * SIZE)  # three times what L1 holds
    for prompt in range(writes):
        write_stored_by_the_first(storage, 100 + prompt)
        storage.clear()
    assert wait_for(lambda: storage.store.pending_batches() < writes - 1)
    # Slices holding at most twice L1's bytes wait; the rest named objects gone from L1.
    assert storage.store.pending_batches() <= BOUND
    assert storage.stats.get("l2_store_skipped_gone") >= PER_WRITE * (writes - 1 - BOUND)
    assert "l1_cleared_before_l2_store" not in storage.stats.failures()
    gated_backend(storage, 1).store_gate.set()
    assert storage.flush(10)
    assert storage.store.pending_batches() == 0


def test_stores_that_cannot_be_submitted_are_logged_once_per_burst(engine, monkeypatch, caplog) -> None:
    # An adapter refusing every submit fails each slice: every one is counted, and the
    # log says so in one line per burst, not one line per slice.
    storage = engine([AdapterSpec(type="gated", config=GatedConfig())])

    def refuse(*args: object, **kwargs: object) -> int:
        raise ConnectionError("the adapter is down")

    monkeypatch.setattr(storage.adapters[0], "submit_store", refuse)
    writes = 5
    with caplog.at_level("WARNING", logger="lmcache_tiers.controllers.store"):
        for prompt in range(writes):
            store(storage, keys_of(200 + prompt, 1), SIZE)
        assert storage.flush(10)
    assert storage.stats.failures().get("l2_store_submit_error") == writes
    lines = [record for record in caplog.records if "could not be submitted" in record.getMessage()]
    assert len(lines) == 1
    assert "the adapter is down" in lines[0].getMessage()


def test_the_bound_on_a_slow_adapters_slices_holds_again_once_it_caught_up(engine, monkeypatch) -> None:
    # A look that finds every waiting slice still holding an object in L1 keeps them all:
    # more than L1's bytes of slices stay.  Once the adapter caught up and fell behind
    # again, its slices of objects gone from L1 are dropped at twice L1's bytes, as at
    # first -- not only past what that look kept.
    # The objects kept for the look stay (no eviction at a watermark): only the test evicts.
    storage = behind_a_slow_adapter(engine, monkeypatch, eviction_trigger_watermark=1.0)
    slow = gated_backend(storage, 1)
    for prompt in range(BOUND + 2):  # one in flight, past the bound waiting
        keys = write_stored_by_the_first(storage, 400 + prompt)
        if prompt:  # (the first is in flight: locked for its store)
            assert storage.evict(keys[1:]) == PER_WRITE - 1  # its first object keeps each slice
    assert wait_for(lambda: storage.store.pending_batches() == BOUND + 1)
    slow.store_gate.set()
    assert storage.flush(10)
    storage.clear()
    skipped = storage.stats.get("l2_store_skipped_gone")
    slow.store_gate.clear()
    writes = BOUND + 2
    for prompt in range(writes):
        write_stored_by_the_first(storage, 500 + prompt)
        storage.clear()
    assert wait_for(lambda: storage.store.pending_batches() < writes - 1), (
        "the slices of objects gone from L1 were kept past twice L1's bytes"
    )
    assert storage.stats.get("l2_store_skipped_gone") > skipped
    slow.store_gate.set()
    assert storage.flush(10)


def test_looking_through_a_slow_adapters_slices_leaves_l1_to_requests(engine, monkeypatch) -> None:
    # Twice L1's bytes of slices can name a hundred thousand keys: looked through under
    # the L1 lock, every store and lookup would wait for all of them (tens of ms).  An
    # object that left L1 never comes back (a write makes a new one), so each key is
    # judged on its own: another thread takes the L1 lock while a slice is looked at.
    storage = behind_a_slow_adapter(engine, monkeypatch)
    lock_was_free: list[bool] = []
    judge = storage.store._still_has_an_object

    def judged_with_the_l1_lock_probed(piece: store_pacing.Slice) -> bool:
        def probe() -> None:
            taken = storage.l1.lock.acquire(blocking=False)
            lock_was_free.append(taken)
            if taken:
                storage.l1.lock.release()

        prober = threading.Thread(target=probe)
        prober.start()
        prober.join()
        return judge(piece)

    monkeypatch.setattr(storage.store, "_still_has_an_object", judged_with_the_l1_lock_probed)
    writes = BOUND + 2  # one in flight, past twice L1's bytes waiting
    for prompt in range(writes):
        write_stored_by_the_first(storage, 600 + prompt)
        storage.clear()
    assert wait_for(lambda: storage.store.pending_batches() < writes - 1)
    assert lock_was_free and all(lock_was_free), "the L1 lock was held across the look"
    gated_backend(storage, 1).store_gate.set()
    assert storage.flush(10)
