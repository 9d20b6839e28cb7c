"""Store controller and the store policies, seen through the StorageManager."""

from __future__ import annotations

import logging

from engine_support import GatedConfig, RecordingSerde, gated_backend, keys_of, mock, payload, store

from lmcache_tiers.config import AdapterSpec

SIZE = 32 * 1024


def gated() -> AdapterSpec:
    return AdapterSpec(type="gated", config=GatedConfig())


def test_default_stores_everything_everywhere_and_keeps_l1(engine, caplog) -> None:
    storage = engine([mock(), mock()])
    keys = keys_of(1, 4)
    with caplog.at_level(logging.DEBUG, logger="lmcache_tiers.controllers.store"):
        store(storage, keys, SIZE)
        assert storage.flush(10)
    for adapter in storage.adapters:
        assert sorted(adapter.iter_keys(), key=keys.index) == keys
    assert all(storage.l1.contains(k) for k in keys)
    assert caplog.text.count("Submitted store task") == 2
    assert caplog.text.count("L2 store task") == 2
    assert "4/4 keys stored" in caplog.text
    status = storage.status()
    for entry in status["adapters"]:
        counts = entry["store_tasks_submitted"], entry["store_tasks_completed"], entry["keys_stored"]
        assert counts == (1, 1, 4)
    assert status["store"]["in_flight_tasks"] == 0
    assert storage.l1.stats().read_locks == 0, "store tasks released their read locks"


def test_skip_l1_with_noop_is_a_buffer_only_l1(engine) -> None:
    storage = engine([mock()], l2_store_policy="skip_l1", eviction_policy="noop")
    keys = keys_of(2, 20)
    for start in range(0, 20, 5):
        store(storage, keys[start : start + 5], SIZE)
    assert storage.flush(10)
    assert len(storage.l1) == 0
    assert storage.l1.used_bytes == 0
    assert sorted(storage.adapters[0].iter_keys(), key=keys.index) == keys
    assert storage.status()["store"]["l1_deleted_after_store"] == 20

    # Served back from L2, and gone from L1 again once read.
    assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == 20
    for obj in storage.read(keys):
        assert bytes(storage.view(obj)) == payload(obj.key, SIZE)
    storage.release(keys, 2)
    assert len(storage.l1) == 0


def test_skip_l1_waits_for_readers(engine) -> None:
    storage = engine([gated()], l2_store_policy="skip_l1")
    adapter = gated_backend(storage)
    adapter.store_gate.clear()
    keys = keys_of(3, 3)
    store(storage, keys, SIZE)
    held = storage.read(keys[:1])
    adapter.store_gate.set()
    assert storage.flush(10)
    assert [storage.l1.contains(k) for k in keys] == [True, False, False]
    assert bytes(storage.view(held[0])) == payload(keys[0], SIZE)
    storage.release(keys[:1])
    assert len(storage.l1) == 0


def test_failed_stores_are_counted_and_stay_in_l1(engine) -> None:
    storage = engine([gated()], l2_store_policy="skip_l1")
    adapter = gated_backend(storage)
    keys = keys_of(4, 3)
    adapter.fail_stores.add(keys[1])
    store(storage, keys, SIZE)
    assert storage.flush(10)
    assert [storage.l1.contains(k) for k in keys] == [False, True, False]
    status = storage.status()
    entry = status["adapters"][0]
    assert (entry["store_tasks_failed"], entry["keys_store_failed"], entry["keys_stored"]) == (1, 1, 2)
    assert status["failures"]["l2_store_failed"] == 1


def test_skip_l1_deletes_a_key_stored_in_any_adapter(engine) -> None:
    storage = engine([gated(), gated()], l2_store_policy="skip_l1")
    first = gated_backend(storage)
    keys = keys_of(5, 2)
    first.fail_stores.update(keys)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    assert len(storage.l1) == 0


def test_close_stores_what_was_committed(engine) -> None:
    storage = engine([mock(namespace="engine-close-drain")])
    keys = keys_of(6, 8)
    store(storage, keys, SIZE)
    storage.close()
    reopened = engine([mock(namespace="engine-close-drain")])
    assert reopened.wait_prefetch(reopened.submit_prefetch(keys), 10) == 8
    reopened.release(keys)


def test_no_adapters_means_l1_only(engine) -> None:
    storage = engine([])
    keys = keys_of(7, 3)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == 3
    storage.release(keys)
    assert storage.status()["adapters"] == []


def test_layouts_reach_the_serde_chain_with_the_full_key(engine) -> None:
    storage = engine([mock(serde=[{"type": "recording"}])])
    keys = keys_of(9, 2)
    reserved = storage.reserve_write(keys, [SIZE, SIZE], ["float16[4,4096]", ""])
    for key, obj in reserved.items():
        storage.view(obj)[:] = payload(key, SIZE)
    storage.commit_write(keys)
    assert storage.flush(10)
    contexts = {context.key: context for context in RecordingSerde.seen if context.key in keys}
    assert contexts[keys[0]].layout == "float16[4,4096]"
    assert contexts[keys[0]].tensor_layout is not None
    assert contexts[keys[1]].layout == ""
    assert {context.size for context in contexts.values()} == {SIZE}
