"""A stop counts every prefetch it gives up: the running ones and the queued ones alike."""

from __future__ import annotations

import logging
import threading

from engine_support import GatedConfig, gated_backend, keys_of, store

from lmcache_tiers.config import AdapterSpec

SIZE = 64 * 1024


def gated() -> AdapterSpec:
    return AdapterSpec(type="gated", config=GatedConfig())


def test_prefetches_still_queued_at_the_stop_are_counted_and_logged(engine, caplog) -> None:
    storage = engine([gated()], l2_prefetch_max_in_flight=1)
    running_keys, queued_keys = keys_of(1, 2), keys_of(2, 2)
    store(storage, running_keys + queued_keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    backend = gated_backend(storage)
    backend.gate.clear()
    running = storage.submit_prefetch(running_keys)
    assert backend.loads_started.acquire(timeout=10)
    queued = [storage.submit_prefetch(queued_keys), storage.submit_prefetch(running_keys)]
    assert storage.status()["prefetch"]["queued"] == 2

    with caplog.at_level(logging.WARNING):
        closer = threading.Thread(target=storage.close, kwargs={"drain_timeout_s": 0.0})
        closer.start()
        for handle in queued:
            assert storage.wait_prefetch(handle, 10) == 0
        backend.gate.set()
        closer.join(30)
    assert not closer.is_alive()
    assert storage.query_prefetch(running) == 0, "given up by the drain deadline"
    assert storage.failures().get("prefetch_abandoned") == 3, "one running, two queued"
    assert "2 queued prefetch requests abandoned at the stop (prefetch_abandoned)" in caplog.text
