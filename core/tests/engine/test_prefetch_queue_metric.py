"""/metrics tells prefetch requests waiting for a slot from those running: the sum alone
cannot show requests piling up behind ``--l2-prefetch-max-in-flight``."""

from __future__ import annotations

from engine_support import GatedConfig, gated_backend, keys_of, store
from prometheus_client.parser import text_string_to_metric_families

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.server.metrics import build_registry, render

SIZE = 64 * 1024


def in_flight(text: str) -> dict[str, float]:
    return {
        sample.labels["kind"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "lmcache_tiers_in_flight"
        for sample in family.samples
    }


def test_queued_prefetches_have_their_own_gauge(engine) -> None:
    storage = engine([AdapterSpec(type="gated", config=GatedConfig())], l2_prefetch_max_in_flight=1)
    running_keys, queued_keys = keys_of(1, 2), keys_of(2, 2)
    store(storage, running_keys + queued_keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    backend = gated_backend(storage)
    backend.gate.clear()
    storage.submit_prefetch(running_keys)
    assert backend.loads_started.acquire(timeout=10)
    storage.submit_prefetch(queued_keys)
    storage.submit_prefetch(queued_keys + running_keys)

    gauges = in_flight(render(build_registry(lambda: [], storage.status)).decode())
    backend.gate.set()
    assert gauges["l2_prefetches_queued"] == 2
    assert gauges["l2_prefetches"] == 3, "running and queued"
