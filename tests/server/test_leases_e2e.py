"""A reader's zero-copy views across process boundaries: another client's forced clear and
new stores never show through them, and /metrics counts what was held back."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

from tiers_e2e import (
    ServerProcess,
    digest,
    fetch,
    job_force_clear_and_store,
    make_keys,
    make_payloads,
    metric,
)

from lmcache_tiers.client import Client

SPAWN = multiprocessing.get_context("spawn")
CHUNK = 1 << 20


def test_another_tenants_forced_clear_never_shows_through_views(server: ServerProcess) -> None:
    keys, data = make_keys("held", 8), make_payloads("held", 8, CHUNK)
    with Client(server.url) as reader:
        assert reader.uses_shm
        assert reader.store(keys, data) == 8
        with reader.retrieve(keys) as views, ProcessPoolExecutor(1, mp_context=SPAWN) as pool:
            cleared, stored = pool.submit(job_force_clear_and_store, server.url, "intruder", 8, CHUNK).result(
                120
            )
            assert (cleared, stored) == (8, 8)
            assert digest(views) == digest(data)
        assert reader.lookup(keys) == 0
        l1 = reader.status()["l1"]
    assert (l1["objects"], l1["read_locks"], l1["leases"]["quarantined_extents"]) == (8, 0, 0)

    assert server.http_url is not None
    _, _, text = fetch(f"{server.http_url}/metrics")
    assert metric(text, "lmcache_tiers_l1_quarantined_total", 'reason="forced"') == 8
    assert metric(text, "lmcache_tiers_l1_quarantine_reclaimed_total", 'how="released"') == 8
    assert metric(text, "lmcache_tiers_l1_quarantined_bytes") == 0
