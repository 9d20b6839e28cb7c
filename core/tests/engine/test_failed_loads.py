"""A failed L2 load never becomes readable, and is never stored back as a fresh write."""

from __future__ import annotations

import random
import time

from engine_support import (
    GatedConfig,
    gated_backend,
    keys_of,
    mock,
    parked_prefetch,
    payload,
    spec,
    store,
    store_in_l2_only,
)

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.storage import StorageManager

SIZE = 32 * 1024


def expire_reservations(storage: StorageManager) -> int:
    """Take every write reservation away, as its TTL would (forced clears leave objects
    being written alone); returns how many objects' locks expired."""
    return storage.l1.expire_locks(now=time.monotonic() + storage.l1.write_ttl_s + 1)


def look_up_and_check(storage: StorageManager, keys: list[ObjectKey], failure: str) -> int:
    """Prefetch ``keys``, check every byte of the prefix found, release it; its length."""
    hits = storage.wait_prefetch(storage.submit_prefetch(keys), 30)
    assert hits is not None
    for obj in storage.read(keys[:hits]):
        assert bytes(storage.view(obj)) == payload(obj.key, SIZE), failure
    storage.release(keys[:hits], 2)
    return hits


def test_a_writers_late_commit_cannot_publish_a_prefetch_reservation(engine) -> None:
    storage = engine([AdapterSpec(type="gated", config=GatedConfig())])
    adapter = gated_backend(storage)
    keys = keys_of(1, 1)
    store_in_l2_only(storage, keys, SIZE)
    stores_before = storage.status()["adapters"][0]["store_tasks_submitted"]

    # A writer reserves the key, and its write TTL takes the reservation away from it.
    (writer,) = storage.reserve_write(keys, [SIZE]).values()
    storage.view(writer)[:] = b"\xee" * SIZE
    assert storage.clear(force=True) == 0, "a forced clear leaves objects being written alone"
    assert expire_reservations(storage) == 1
    # A prefetch reserves the key to load it; its load is held, then fails after scribbling.
    adapter.gate.clear()
    adapter.fail_loads.update(keys)
    handle = storage.submit_prefetch(keys)
    assert adapter.loads_started.acquire(timeout=10)
    # The writer, unaware, commits, then aborts: neither touches the prefetch's object.
    assert storage.commit_write(keys) == [False]
    storage.abort_write(keys)
    assert storage.l1.contains(keys[0]), "the writer's abort freed an object a load is filling"
    assert storage.read(keys) == []
    adapter.gate.set()
    assert storage.wait_prefetch(handle, 10) == 0
    assert not storage.l1.contains(keys[0])
    assert storage.read(keys) == []
    assert storage.flush(10)
    assert storage.status()["adapters"][0]["store_tasks_submitted"] == stores_before, "stored back"
    assert adapter._data[keys[0]] == payload(keys[0], SIZE)
    # Only the writer's expired extent is still held back (its writer might still be
    # copying into it), until its lease ends.
    assert storage.l1.stats() == (0, SIZE, 0, 0, 0)
    assert storage.l1.lease_stats().quarantined_bytes == SIZE


def test_a_prefetch_never_hands_over_a_writers_object(engine) -> None:
    """The reverse race: the prefetch's reservation expires and a writer takes the key;
    the load's late hand-off (and its clean-up) must leave the writer's object alone."""
    storage = engine([AdapterSpec(type="gated", config=GatedConfig())])
    adapter = gated_backend(storage)
    keys = keys_of(2, 1)
    handle = parked_prefetch(storage, keys, SIZE)
    assert expire_reservations(storage) == 1
    (writer,) = storage.reserve_write(keys, [SIZE]).values()
    adapter.gate.set()
    assert storage.wait_prefetch(handle, 10) == 0
    assert storage.l1.get(keys[0]) is writer and writer.state.value == "writing"
    storage.view(writer)[:] = payload(keys[0], SIZE)
    assert storage.commit_write(keys) == [True]


def test_an_expired_load_reservation_never_lets_the_load_overwrite_another_object(engine) -> None:
    storage = engine([AdapterSpec(type="gated", config=GatedConfig())])
    adapter = gated_backend(storage)
    loaded, other = keys_of(3, 1), keys_of(4, 1)
    handle = parked_prefetch(storage, loaded, SIZE)
    assert expire_reservations(storage) == 1
    # The extent the load writes into is not free: a new object gets another one.
    (writer,) = storage.reserve_write(other, [SIZE]).values()
    storage.view(writer)[:] = payload(other[0], SIZE)
    assert storage.commit_write(other) == [True]
    used = storage.l1.used_bytes
    adapter.gate.set()
    assert storage.wait_prefetch(handle, 10) == 0
    (obj,) = storage.read(other)
    assert bytes(storage.view(obj)) == payload(other[0], SIZE), "the load wrote into another object"
    storage.release(other)
    # The load's extent left the load once it reported, into the quarantine of expired
    # reservations (not to a new object) until its lease ends.
    assert storage.l1.used_bytes == used
    assert storage.l1.lease_stats().quarantined_bytes == SIZE, "the held extent went back to L1's leases"
    assert storage.l1.stats().write_locked == 0


def test_faulty_and_corrupt_loads_are_never_read_nor_stored(engine) -> None:
    """Loads failing, corrupted (and detected), and writers whose reservations expire, while
    the store controller runs: every byte read is right, and so is every byte in L2."""
    namespace = "failed-loads-soak"
    faulty = spec(
        {
            "type": "fault_inject",
            "inner": {"type": "mock", "max_size_gb": 0.25, "namespace": namespace},
            "seed": 5,
            "load_fail_rate": 0.25,
            "corrupt_rate": 0.25,
            "corrupt_detected": True,
            "delay_s": 0.001,
            "delay_rate": 0.3,
            "delay_ops": ["load"],
        }
    )
    storage = engine([faulty], l2_prefetch_max_in_flight=4)
    rng = random.Random(77)
    written: set[int] = set()
    reads = raced = 0
    for _ in range(3000):
        prompt = rng.randrange(60)
        keys = keys_of(prompt, rng.randint(1, 4))
        choice = rng.random()
        if choice < 0.3:
            try:
                store(storage, keys, SIZE)
                written.add(prompt)
            except L1OutOfMemoryError:
                pass
        elif choice < 0.85:
            reads += look_up_and_check(storage, keys, "read a failed load")
        elif choice < 0.95:
            # A writer whose reservation expired, committing while a prefetch of the same
            # keys may be loading them.  (Expiry waits for running L2 stores, whose read
            # locks it would drop too: what they read is the business of L1's quarantine.)
            assert storage.flush(30)
            reserved = storage.reserve_write(keys, [SIZE] * len(keys))
            for obj in reserved.values():
                storage.view(obj)[:] = b"\xee" * SIZE
            expire_reservations(storage)
            handle = storage.submit_prefetch(keys)
            assert storage.commit_write(list(reserved)) == [False] * len(reserved)
            hits = storage.wait_prefetch(handle, 30)
            assert hits is not None
            storage.release(keys[:hits])
            raced += 1
        else:
            storage.clear()
    assert storage.flush(60)
    status = storage.status()
    assert reads > 500 and raced > 100
    assert status["failures"].get("l2_load_failed", 0) > 100, "the faults did not bite"
    assert storage.adapters[0].stats()["injected_corruptions"] > 50
    assert storage.l1.stats().read_locks == 0 and storage.l1.stats().write_locked == 0
    storage.close()

    # Everything L2 holds, read back through a plain adapter on the same objects.
    checker = engine([mock(max_size_gb=0.25, namespace=namespace)])
    checked = 0
    for prompt in sorted(written):
        keys = keys_of(prompt, 4)
        checked += look_up_and_check(checker, keys, "L2 holds a failed load's bytes")
    assert checked > 0
