"""A prefetch its owner discards while it still waits in the queue gives back what it holds
at once -- the read locks on its L1 prefix, the pins its adapters' answers took -- and
leaves the queue: nobody will read what it would load.  Left queued, a client that gave up
on a slow adapter (its wait ran out, its session ended) kept L1 objects unevictable and L2
keys undeletable for up to the result TTL, and the request then ran its lookups and loads
for nobody, evicting L1 objects to make room for them.

The running request's load waits at the adapter's gate (a threading event) while the
queued one is discarded; nothing is timed.
"""

from __future__ import annotations

from engine_support import GatedConfig, gated_backend, keys_of, store

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.storage import StorageManager

SIZE = 64 * 1024


def answering_now() -> AdapterSpec:
    # Lookups answered on the caller's thread: a queued request holds its pins already.
    return AdapterSpec(type="gated_now", config=GatedConfig())


def in_l2_only(storage: StorageManager, keys: list) -> None:
    store(storage, keys, SIZE)
    assert storage.flush(10)
    assert storage.evict(keys) == len(keys)


def test_a_prefetch_discarded_while_queued_gives_back_its_locks_and_pins_and_loads_nothing(engine) -> None:
    storage = engine([answering_now()], l2_prefetch_max_in_flight=1)
    running_keys, queued_keys = keys_of(1, 2), keys_of(2, 3)
    in_l2_only(storage, running_keys + queued_keys[1:])
    store(storage, queued_keys[:1], SIZE)  # the queued request's L1 prefix
    assert storage.flush(10)
    backend = gated_backend(storage)
    backend.gate.clear()
    running = storage.submit_prefetch(running_keys)
    assert backend.loads_started.acquire(timeout=10)
    queued = storage.submit_prefetch(queued_keys)
    assert storage.prefetch.queued() == 1
    assert storage.l1.get(queued_keys[0]).read_locks == 1
    assert set(storage.adapters[0].pinned_keys()) == set(running_keys + queued_keys[1:])

    storage.discard_prefetch(queued)

    assert storage.prefetch.queued() == 0, "a discarded request still waits for a slot"
    assert storage.l1.get(queued_keys[0]).read_locks == 0, "its L1 prefix stays read-locked"
    assert set(storage.adapters[0].pinned_keys()) == set(running_keys), "its L2 pins are still held"
    assert storage.query_prefetch(queued) == 0
    backend.gate.set()
    assert storage.wait_prefetch(running, 10) == 2
    assert storage.flush(10)
    assert storage.status()["adapters"][0]["keys_loaded"] == 2, "keys were loaded for nobody"
    assert not any(storage.l1.contains(key) for key in queued_keys[1:])
    storage.release(running_keys)
    assert storage.l1.stats().read_locks == 0
    assert storage.adapters[0].pinned_keys() == {}
