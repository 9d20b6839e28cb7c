"""The storage's clear (what CLEAR requests run) serves other callers of L1 between the
batches of its L1 clear, keeps what they store meanwhile, and counts each acknowledged
write it takes before its L2 store exactly once."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from engine_support import GatedStorePolicy, keys_of, mock, store

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1.removal import CLEAR_BATCH, Removal
from lmcache_tiers.storage import StorageManager
from lmcache_tiers.testing.threads import joined

SIZE = 4096
OBJECTS = 2 * CLEAR_BATCH + 1  # three batches


class ServedBetweenBatches:
    """Before each batch of the L1 clear, another thread stores a new key and looks it up
    -- if L1's lock is free then.  Asked without waiting: whether it is free depends on who
    holds it, not on timing (a clear holding it throughout would leave the thread blocked)."""

    def __init__(self, storage: StorageManager, monkeypatch: pytest.MonkeyPatch) -> None:
        self.storage = storage
        self.served: list[bool] = []
        self.stored: list[ObjectKey] = []
        clear_batch = Removal._clear_batch

        def watched_batch(removal: Removal, *args: Any) -> int:
            other = threading.Thread(target=self._store_and_look_up, daemon=True)
            other.start()
            joined(other, "a store and lookup between the clear's batches")
            return clear_batch(removal, *args)

        monkeypatch.setattr(Removal, "_clear_batch", watched_batch)

    def _store_and_look_up(self) -> None:
        lock = self.storage.l1.lock
        if not lock.acquire(blocking=False):
            self.served.append(False)
            return
        lock.release()
        key = keys_of(900 + len(self.served), 1)[0]
        stored = store(self.storage, [key], SIZE)
        self.served.append(stored == [key] and self.storage.l1.prefix_hits([key]) == 1)
        self.stored.append(key)


def test_a_storage_clear_serves_stores_and_lookups_between_batches(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    storage = engine()
    store(storage, keys_of(1, OBJECTS), SIZE)
    other = ServedBetweenBatches(storage, monkeypatch)
    assert storage.clear() == OBJECTS
    assert other.served == [True, True, True]
    # Stored during the clear: newer than it, so kept.
    assert storage.l1.prefix_hits(other.stored) == len(other.stored)


def test_a_batched_clear_counts_each_write_it_takes_before_its_store_once(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    storage = engine([mock()], l2_store_policy="gated")
    settled = keys_of(2, 100)
    store(storage, settled, SIZE)
    assert storage.flush(10)  # in L2: a clear takes them without losing anything
    unstored = keys_of(3, OBJECTS - len(settled))
    store_unstored(storage, unstored)
    other = ServedBetweenBatches(storage, monkeypatch)

    assert storage.clear() == OBJECTS
    assert other.served == [True, True, True]
    # Exactly the acknowledged writes the clear took before their store: neither those
    # already in L2 nor those stored during the clear (still unstored, but kept).
    assert storage.failures().get("l1_cleared_before_l2_store") == len(unstored)
    assert storage.l1.prefix_hits(other.stored) == len(other.stored)

    GatedStorePolicy.gate.set()
    assert storage.flush(10)
    assert storage.failures().get("l1_cleared_before_l2_store") == len(unstored)  # not again


def test_a_clear_cut_short_still_counts_the_writes_its_batches_took(engine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # The L1 clear raising in its second batch (whatever the reason) has taken the first
    # batch's objects for good: those acknowledged writes are lost, and counted.
    storage = engine([mock()], l2_store_policy="gated")
    store_unstored(storage, keys_of(4, CLEAR_BATCH + 1))
    clear_batch = Removal._clear_batch
    batches: list[int] = []

    def failing_second_batch(removal: Removal, *args: Any) -> int:
        batches.append(len(batches))
        if len(batches) == 2:
            raise RuntimeError("the second batch failed")
        return clear_batch(removal, *args)

    monkeypatch.setattr(Removal, "_clear_batch", failing_second_batch)
    with pytest.raises(RuntimeError, match="second batch"):
        storage.clear()
    assert storage.failures().get("l1_cleared_before_l2_store") == CLEAR_BATCH


def store_unstored(storage: StorageManager, keys: list[ObjectKey]) -> None:
    """Store ``keys`` with the store controller parked in the (gated) store policy: every
    one is committed, queued for L2 and unstored until the gate opens."""
    while GatedStorePolicy.entered.acquire(blocking=False):
        pass
    GatedStorePolicy.gate.clear()  # the store controller parks on the next commit
    for start in range(0, len(keys), 64):  # commits of their own
        store(storage, keys[start : start + 64], SIZE)
    assert GatedStorePolicy.entered.acquire(timeout=10), "the store controller never took the commits"
