"""A store the close's drain gave up on counts its object lost once: never also as an
eviction of an unstored object, whatever runs between giving its locks back and counting."""

from __future__ import annotations

import time
from typing import Any

from engine_support import GatedConfig, gated_backend, keys_of, store

from lmcache_tiers.config import AdapterSpec

SIZE = 64 << 10


def wait_for(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_an_eviction_as_the_store_controller_gives_back_its_locks_counts_nothing_twice(
    engine: Any, monkeypatch: Any
) -> None:
    storage = engine([AdapterSpec(type="gated", config=GatedConfig())])
    stalled = gated_backend(storage)
    stalled.store_gate.clear()
    (key,) = keys_of(1, 1)
    store(storage, [key], SIZE)
    wait_for(lambda: storage.status()["adapters"][0]["store_tasks_submitted"] >= 1, "the stalled store")
    l1 = storage.l1
    give_back = l1.finish_store
    evicted: list[int] = []

    def give_back_then_evict(objs: Any) -> None:
        # The L1 eviction controller stops after the store controller: its round (here,
        # on the store controller's thread) may land as soon as the locks are given back.
        give_back(objs)
        if not evicted:
            evicted.append(storage.l1_eviction.evict_now(l1.capacity_bytes))
        stalled.store_gate.set()  # the adapter's close then ends

    monkeypatch.setattr(l1, "finish_store", give_back_then_evict)
    storage.close(drain_timeout_s=0.05)
    assert evicted and evicted[0] > 0, "the object was evicted once its lock was given back"
    failures = storage.failures()
    lost = failures.get("l2_store_abandoned", 0) + failures.get("evicted_before_l2_store", 0)
    assert lost == 1, failures
