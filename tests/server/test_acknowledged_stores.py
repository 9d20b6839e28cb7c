"""A store storm at twice L1's capacity in front of a slow L2: every acknowledged chunk is
readable from L2 afterwards, or counted as lost in /metrics -- exactly."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tiers_e2e import digest, make_keys, make_payloads, start_server
from trust_jobs import failures_in_metrics, job_acknowledged_storm, wait_for_l2_stores

from lmcache_tiers.client import Client

SPAWN = multiprocessing.get_context("spawn")
L1_MIB = 64
CHUNK = 256 << 10
BATCH = 4
WORKERS = 2
BATCHES = 2 * L1_MIB * (1 << 20) // (CHUNK * BATCH * WORKERS)  # 2x L1 in all
LOST = "evicted_before_l2_store"


def test_store_storm_every_acknowledged_chunk_reaches_l2_or_is_counted(tmp_path: Path) -> None:
    server = start_server(
        tmp_path / "server",
        adapters=[{"type": "mock", "max_size_gb": 1.0, "bandwidth_bytes_per_s": 150_000_000}],
        l1_size_gb=L1_MIB / 1024,
    )
    try:
        with ProcessPoolExecutor(WORKERS, mp_context=SPAWN) as pool:
            futures = [
                pool.submit(job_acknowledged_storm, server.url, worker, CHUNK, BATCHES, BATCH)
                for worker in range(WORKERS)
            ]
            results = [future.result(timeout=300) for future in futures]
        tags = [tag for result in results for tag in result["acknowledged"]]
        acknowledged = len(tags) * BATCH
        assert acknowledged > L1_MIB * (1 << 20) // CHUNK, f"the storm did not overflow L1: {results}"
        with Client(server.url, timeout=60) as client:
            wait_for_l2_stores(client)
            status = client.status()
            assert sum(adapter["keys_store_failed"] for adapter in status["adapters"]) == 0
            lost = failures_in_metrics(server.http_url).get(LOST, 0.0)
            # Empty L1, then ask for every acknowledged chunk on its own: a hit comes from L2.
            client.clear()
            readable = 0
            for tag in tags:
                keys, expected = make_keys(tag, BATCH), digest(make_payloads(tag, BATCH, CHUNK))
                for key, want in zip(keys, expected, strict=True):
                    if client.lookup([key]) == 1:
                        with client.retrieve([key]) as views:
                            assert digest(views) == [want], f"{tag}: L2 returned other bytes"
                        readable += 1
        print(
            f"\nstore storm through the server: {readable}/{acknowledged} acknowledged chunks reached L2 "
            f"({readable / acknowledged:.1%}); {lost:.0f} counted as {LOST}; "
            f"{sum(r['refused'] for r in results)} batches refused"
        )
        assert acknowledged - readable == lost
        log = server.output()
        assert (log.count("evicted before their L2 store") >= 1) == (lost > 0)
    finally:
        assert server.stop() == 0, server.output()
