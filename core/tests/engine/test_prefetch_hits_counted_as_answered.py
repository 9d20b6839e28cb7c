"""``lookup_hit_chunks`` counts the hits lookups were answered: a prefetch that went to L2
and ended with no hits for its owner -- given up at its result deadline, still running or
still queued, or cancelled by a stop -- counts none, even the L1 prefix it had locked
for a while.  An operator's hit ratio is hits over keys asked, and those lookups were
misses."""

from __future__ import annotations

import threading

from engine_support import GatedConfig, gated_backend, keys_of, store

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.storage import StorageManager

SIZE = 64 * 1024


def gated() -> AdapterSpec:
    return AdapterSpec(type="gated", config=GatedConfig())


def hit_chunks(storage: StorageManager) -> tuple[int, int]:
    return storage.stats.get("l1_hit_chunks"), storage.stats.get("l2_hit_chunks")


def first_in_l1_rest_in_l2(storage: StorageManager, prompts: list[list]) -> None:
    """Every key of ``prompts`` in L2; the first of each in L1 too (a prefix hit there)."""
    store(storage, [key for keys in prompts for key in keys], SIZE)
    assert storage.flush(10)
    storage.clear()
    store(storage, [keys[0] for keys in prompts], SIZE)
    assert storage.flush(10)


def test_prefetches_given_up_at_their_deadline_count_no_hits(engine) -> None:
    # Results are kept half the lock TTL: each request is given up 0.5 s after it starts.
    storage = engine([gated()], l2_prefetch_max_in_flight=1, l1_lock_ttl_s=1.0)
    running_keys, queued_keys = keys_of(1, 2), keys_of(2, 2)
    first_in_l1_rest_in_l2(storage, [running_keys, queued_keys])
    backend = gated_backend(storage)
    backend.gate.clear()  # every load parks: an adapter hung with no timeout of its own
    running = storage.submit_prefetch(running_keys)
    assert backend.loads_started.acquire(timeout=10)
    queued = storage.submit_prefetch(queued_keys)  # behind the only slot
    assert storage.status()["prefetch"]["queued"] == 1

    # Both end with no result, whichever way the queued one goes (given up in the queue,
    # or started when the slot freed and parked at the gate in its turn): 0 hits each.
    assert storage.wait_prefetch(running, 10) == 0
    assert storage.wait_prefetch(queued, 10) == 0
    assert storage.failures()["prefetch_timed_out"] == 2
    assert hit_chunks(storage) == (0, 0), "hits counted for lookups answered as misses"

    backend.gate.set()
    assert storage.flush(10)
    # Answered, they count: the L1 prefix as an L1 hit, the loaded key as an L2 one.
    again = storage.submit_prefetch(running_keys)
    assert storage.wait_prefetch(again, 10) == 2
    assert hit_chunks(storage) == (1, 1)
    storage.release(running_keys)


def test_a_prefetch_cancelled_in_the_queue_by_a_stop_counts_no_hits(engine) -> None:
    storage = engine([gated()], l2_prefetch_max_in_flight=1)
    running_keys, queued_keys = keys_of(3, 2), keys_of(4, 2)
    first_in_l1_rest_in_l2(storage, [running_keys, queued_keys])
    backend = gated_backend(storage)
    backend.gate.clear()
    running = storage.submit_prefetch(running_keys)
    assert backend.loads_started.acquire(timeout=10)
    queued = storage.submit_prefetch(queued_keys)
    assert storage.status()["prefetch"]["queued"] == 1

    closer = threading.Thread(target=storage.close, kwargs={"drain_timeout_s": 0.0})
    closer.start()
    assert storage.wait_prefetch(queued, 10) == 0, "a queued request is cancelled with no hits"
    backend.gate.set()
    closer.join(30)
    assert not closer.is_alive()
    assert storage.query_prefetch(running) == 0, "given up by the drain deadline"
    assert hit_chunks(storage) == (0, 0), "hits counted for lookups answered as misses"
