"""The server in its own process, clients in processes of their own."""

from __future__ import annotations

import multiprocessing
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from tiers_e2e import (
    ServerProcess,
    digest,
    job_lookup_retrieve,
    job_mixed,
    job_store,
    job_vanish_holding_locks,
    make_keys,
    make_payloads,
    start_server,
)

from lmcache_tiers.client import Client

SPAWN = multiprocessing.get_context("spawn")
CHUNK = 256 << 10


def run_in_process(function: Any, *args: Any) -> Any:
    with ProcessPoolExecutor(1, mp_context=SPAWN) as pool:
        return pool.submit(function, *args).result(timeout=120)


@pytest.mark.parametrize(("store_shm", "retrieve_shm"), [(True, True), (False, True), (True, False)])
def test_store_in_one_process_retrieve_in_another(
    server: ServerProcess, store_shm: bool, retrieve_shm: bool
) -> None:
    stored, used_shm = run_in_process(job_store, server.url, "handover", 6, CHUNK, store_shm)
    assert (stored, used_shm) == (6, store_shm)

    hits, retrieved, equal, used_shm = run_in_process(
        job_lookup_retrieve, server.url, "handover", 6, CHUNK, retrieve_shm
    )
    assert (hits, retrieved, equal, used_shm) == (6, 6, True, retrieve_shm)

    with Client(server.url) as client:
        l1 = client.status()["l1"]
    assert l1["objects"] == 6
    assert (l1["read_locks"], l1["write_locked"]) == (0, 0), "a client left locks behind"


def wait_stored_in_l2(client: Client, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while client.status()["adapters"][0]["keys_stored"] < count:
        assert time.monotonic() < deadline, "the store controller never wrote the chunks to L2"
        time.sleep(0.05)


def test_lookup_missing_l1_prefetches_from_l2(server_with_l2: ServerProcess) -> None:
    url = server_with_l2.url
    assert run_in_process(job_store, url, "cold", 8, CHUNK, True) == (8, True)
    with Client(url) as client:
        wait_stored_in_l2(client, 8)
        assert client.clear() == 8  # L1 is now empty; only L2 has the chunks
        assert client.status()["l1"]["objects"] == 0

    # A prompt with the 8 cached chunks followed by 2 never stored: 8 hits, all from L2.
    hits, retrieved, equal, _ = run_in_process(job_lookup_retrieve, url, "cold", 8, CHUNK, True)
    assert (hits, retrieved, equal) == (8, 8, True)
    with Client(url) as client:
        keys = make_keys("cold", 8) + make_keys("never-stored", 2)
        assert client.lookup(keys, timeout=30) == 8
        client.release(keys)
        status = client.status()
    assert status["requests"]["l2_hit_chunks"] >= 8
    assert status["l1"]["read_locks"] == 0

    metrics = urllib.request.urlopen(f"{server_with_l2.http_url}/metrics", timeout=10).read().decode()
    l2_hits = [
        line
        for line in metrics.splitlines()
        if line.startswith('lmcache_tiers_lookup_hit_chunks_total{tier="l2"}')
    ]
    assert l2_hits and float(l2_hits[0].split()[-1]) >= 8


def test_partial_prefix_from_l2_stops_at_first_gap(server_with_l2: ServerProcess) -> None:
    url = server_with_l2.url
    keys = make_keys("gap", 6)
    data = make_payloads("gap", 6, CHUNK)
    with Client(url) as client:
        # chunk 3 is never stored: only chunks 0-2 form a usable prefix
        assert client.store(keys[:3] + keys[4:], data[:3] + data[4:]) == 5
        wait_stored_in_l2(client, 5)
        client.clear()
    with Client(url, shm=False) as client:
        assert client.lookup(keys, timeout=30) == 3
        with client.retrieve(keys) as views:
            assert digest(views) == digest(data[:3])


def test_eight_concurrent_client_processes(server: ServerProcess) -> None:
    with ProcessPoolExecutor(8, mp_context=SPAWN) as pool:
        futures = [pool.submit(job_mixed, server.url, worker, 6, 64 << 10) for worker in range(8)]
        results = [future.result(timeout=180) for future in futures]
    assert all(result["checked"] == 6 * 8 for result in results)
    # each worker stored its own 4 chunks per round; the shared 4 were stored once overall
    assert sum(result["stored"] for result in results) == 8 * 6 * 4 + 4
    with Client(server.url) as client:
        status = client.status()
        assert client.ping() > 0
    assert (status["l1"]["read_locks"], status["l1"]["write_locked"]) == (0, 0)
    assert status["server"]["failures"] == {}
    health = urllib.request.urlopen(f"{server.http_url}/healthz", timeout=10)
    assert health.status == 200


def test_locks_of_a_vanished_client_expire(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server", metrics=False, l1_lock_ttl_s=1.0, l1_write_ttl_s=1.0)
    try:
        assert run_in_process(job_store, server.url, "vanish", 3, 4096, True) == (3, True)
        process = SPAWN.Process(target=job_vanish_holding_locks, args=(server.url, "vanish", 3))
        process.start()
        process.join(60)
        assert process.exitcode == 0
        with Client(server.url) as client:
            held = client.status()["l1"]
            assert (held["read_locks"], held["write_locked"], held["objects"]) == (3, 2, 5)
            # L1 reaps expired locks on its own schedule (every few seconds)
            deadline = time.monotonic() + 30
            while (l1 := client.status()["l1"])["read_locks"] or l1["write_locked"]:
                assert time.monotonic() < deadline, f"locks of a dead client never expired: {l1}"
                time.sleep(0.1)
            assert l1["objects"] == 3  # the unfinished reservations were freed
            assert client.lookup(make_keys("vanish", 3)) == 3
            client.release(make_keys("vanish", 3))
    finally:
        assert server.stop() == 0, server.output()
