"""``flush`` is not idle while a given-up prefetch's load still holds L1 reservations."""

from __future__ import annotations

from engine_support import GatedConfig, gated_backend, keys_of, store

from lmcache_tiers.config import AdapterSpec

SIZE = 64 * 1024


def test_flush_waits_for_the_load_of_a_prefetch_given_up_at_its_deadline(engine) -> None:
    # Results are kept half the lock TTL: the prefetch is given up 0.5 s after it starts.
    storage = engine([AdapterSpec(type="gated", config=GatedConfig())], l1_lock_ttl_s=1.0)
    keys = keys_of(1, 2)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    backend = gated_backend(storage)
    backend.gate.clear()  # the load parks: an adapter hung with no timeout of its own
    handle = storage.submit_prefetch(keys)
    assert backend.loads_started.acquire(timeout=10)
    assert storage.wait_prefetch(handle, 10) == 0, "given up at its result deadline"
    assert storage.status()["failures"]["prefetch_timed_out"] == 1

    # The parked load still fills two L1 reservations: flush must not call that idle.
    assert storage.l1.stats().write_locked == 2
    assert not storage.flush(0.5), "flush reported idle while a given-up load holds L1 reservations"
    assert storage.l1.stats().write_locked == 2

    backend.gate.set()
    assert storage.flush(10)
    # Once flush returns the load has reported and given everything back.
    assert storage.l1.stats().write_locked == 0
    assert storage.adapters[0].pinned_keys() == {}
    assert not any(storage.l1.contains(key) for key in keys)
