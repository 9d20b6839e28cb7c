"""The storage's clear (what CLEAR requests run) lets other callers at L1 between the
batches of its L1 clear, and still counts each acknowledged write it takes before its L2
store exactly once."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from engine_support import GatedStorePolicy, keys_of, mock, store

from lmcache_tiers.l1.removal import CLEAR_BATCH, Removal
from lmcache_tiers.storage import StorageManager

SIZE = 4096
OBJECTS = 2 * CLEAR_BATCH + 1  # three batches


def lock_free_before_each_batch(storage: StorageManager, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Before each batch of the L1 clear, whether another thread could take the L1 lock
    then (asked without waiting: the answer depends on who holds it, not on timing)."""
    free: list[bool] = []
    clear_batch = Removal._clear_batch

    def probe() -> None:
        taken = storage.l1.lock.acquire(blocking=False)
        if taken:
            storage.l1.lock.release()
        free.append(taken)

    def watched_batch(removal: Removal, *args: Any) -> int:
        prober = threading.Thread(target=probe)
        prober.start()
        prober.join()
        return clear_batch(removal, *args)

    monkeypatch.setattr(Removal, "_clear_batch", watched_batch)
    return free


def test_the_storage_clear_lets_go_of_the_l1_lock_between_batches(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    storage = engine()
    store(storage, keys_of(1, OBJECTS), SIZE)
    free = lock_free_before_each_batch(storage, monkeypatch)
    assert storage.clear() == OBJECTS
    assert free == [True, True, True]


def test_a_batched_clear_counts_each_write_it_takes_before_its_store_once(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    storage = engine([mock()], l2_store_policy="gated")
    GatedStorePolicy.gate.clear()  # committed objects stay queued: unlocked and unstored
    keys = keys_of(2, OBJECTS)
    store(storage, keys, SIZE)
    assert GatedStorePolicy.entered.acquire(timeout=10)
    free = lock_free_before_each_batch(storage, monkeypatch)
    assert storage.clear() == OBJECTS
    assert free == [True, True, True]
    assert storage.status()["failures"]["l1_cleared_before_l2_store"] == OBJECTS
    GatedStorePolicy.gate.set()
    assert storage.flush(10)
    assert list(storage.adapters[0].iter_keys()) == []
    assert storage.status()["store"]["skipped_gone"] == OBJECTS
