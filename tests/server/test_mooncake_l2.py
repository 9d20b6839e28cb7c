"""Real servers whose L2 is one Mooncake Store pool (master and segment host on loopback).

A server restart finds what it stored; two servers share their chunks; a master killed
mid-run turns lookups into misses and failed stores (counted) and opens the adapter's
circuit, and after it restarts the circuit closes by itself and the same server stores
and hits again.  These are the commands of docs/adapters/mooncake.md's
"Deployment" section.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tiers_e2e import (
    ServerProcess,
    fetch,
    job_lookup_retrieve,
    job_store,
    make_keys,
    metric,
    run_in_process,
    start_server,
    stop_cleanly,
    wait_stored_in_l2,
)

from lmcache_tiers.client import Client

if importlib.util.find_spec("lmcache_plugin_mooncake") is None:
    pytest.skip("lmcache-plugin-mooncake is not installed", allow_module_level=True)

from lmcache_plugin_mooncake.cluster import LocalCluster, unavailable_reason

CHUNK = 256 << 10
#: the servers' Mooncake clients use the loopback address (the 0.3.13 wheel still binds
#: their listening ports to all interfaces)
LOOPBACK = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    reason = unavailable_reason()
    if reason is not None:
        print(f"\nMooncake server tests skipped: {reason}")
        pytest.skip(reason)
    pool = LocalCluster(tmp_path / "mooncake").start()
    try:
        pool.add_segment_host("256MB")
        yield pool
    finally:
        pool.stop()


def serve(log_dir: Path, cluster: LocalCluster, **fields: Any) -> ServerProcess:
    return start_server(log_dir, adapters=[cluster.adapter(**fields)], env=LOOPBACK)


def test_a_restarted_server_finds_what_it_stored(tmp_path: Path, cluster: LocalCluster) -> None:
    first = serve(tmp_path / "first", cluster)
    try:
        assert run_in_process(job_store, first.url, "restart", 6, CHUNK, True) == (6, True)
        wait_stored_in_l2(first, 6)
    finally:
        stop_cleanly(first)
    second = serve(tmp_path / "second", cluster)
    try:
        hits, retrieved, equal, _ = run_in_process(job_lookup_retrieve, second.url, "restart", 6, CHUNK, True)
        assert (hits, retrieved, equal) == (6, 6, True)
        with Client(second.url) as client:
            adapter = client.status()["adapters"][0]
        assert adapter["backend"]["scan_keys"] == 6, "the master's listing accounted them at start"
    finally:
        stop_cleanly(second)


def test_two_servers_share_one_pool(tmp_path: Path, cluster: LocalCluster) -> None:
    one = serve(tmp_path / "one", cluster, global_segment_size="64MB")
    two = serve(tmp_path / "two", cluster, global_segment_size="64MB")
    try:
        assert run_in_process(job_store, one.url, "shared", 8, CHUNK, True) == (8, True)
        wait_stored_in_l2(one, 8)
        hits, retrieved, equal, _ = run_in_process(job_lookup_retrieve, two.url, "shared", 8, CHUNK, True)
        assert (hits, retrieved, equal) == (8, 8, True)
        with Client(two.url) as client:
            assert client.status()["requests"]["l2_hit_chunks"] == 8
    finally:
        stop_cleanly(one)
        stop_cleanly(two)


def test_a_master_killed_mid_run_degrades_to_misses_and_recovers(
    tmp_path: Path, cluster: LocalCluster
) -> None:
    # Two failed calls in a row open the circuit (the default five would each wait out a
    # call against the dead master), and a closed circuit is noticed within 0.2 s.
    circuit = {"failure_threshold": 2, "probe_interval_s": 0.2}
    server = serve(tmp_path / "server", cluster, operation_timeout_s=1.0, circuit=circuit)
    try:
        assert run_in_process(job_store, server.url, "before", 4, CHUNK, True) == (4, True)
        wait_stored_in_l2(server, 4)
        with Client(server.url, timeout=30) as client:
            assert client.clear() == 4  # only the pool holds them now
            cluster.kill_master()
            started = time.monotonic()
            assert client.lookup(make_keys("before", 4), timeout=30) == 0
            assert time.monotonic() - started < 20, "a lookup against a dead master must not hang"
        # The server keeps serving from L1 throughout, and counts the L2 failures.
        assert run_in_process(job_store, server.url, "during", 4, CHUNK, True) == (4, True)
        hits, retrieved, equal, _ = run_in_process(job_lookup_retrieve, server.url, "during", 4, CHUNK, True)
        assert (hits, retrieved, equal) == (4, 4, True)
        assert server.http_url is not None
        deadline = time.monotonic() + 60
        while True:
            _, _, text = fetch(server.http_url + "/metrics")
            if (
                "l2_store_failed" in text
                and metric(text, "lmcache_tiers_failures_total", 'reason="l2_store_failed"') >= 4
            ):
                break
            assert time.monotonic() < deadline, f"store failures never showed in /metrics:\n{text}"
            time.sleep(0.2)
        with Client(server.url) as client:
            backend = client.status()["adapters"][0]["backend"]
            assert backend["backend_errors"] >= 2, backend
            for _ in range(5):  # repeated failures open the circuit
                if client.status()["adapters"][0]["backend"]["circuit_open"]:
                    break
                client.lookup(make_keys("before", 4), timeout=30)
        _, _, text = fetch(server.http_url + "/metrics")
        assert metric(text, "lmcache_tiers_adapter_circuit_open", 'adapter="0:mooncake_store"') == 1.0

        cluster.start_master()  # same ports; the pool starts empty
        cluster.wait_for_segments(1)
        # A store made while the circuit is still open is skipped, and the loop below would
        # wait out its settle time for it: store once a probe has closed the circuit.
        deadline = time.monotonic() + 60
        with Client(server.url, timeout=30) as client:
            while client.status()["adapters"][0]["backend"]["circuit_open"]:
                assert time.monotonic() < deadline, "the circuit never closed after the master came back"
                time.sleep(0.1)
        deadline = time.monotonic() + 90
        attempt = 0
        while True:
            tag = f"after-{attempt}"
            with Client(server.url, timeout=30) as client:
                before = client.status()["adapters"][0]["keys_stored"]
            assert run_in_process(job_store, server.url, tag, 2, CHUNK, True) == (2, True)
            with Client(server.url, timeout=30) as client:
                settle = time.monotonic() + 10
                while (
                    client.status()["adapters"][0]["keys_stored"] < before + 2 and time.monotonic() < settle
                ):
                    time.sleep(0.1)
                if client.status()["adapters"][0]["keys_stored"] >= before + 2:
                    break  # stored in the pool again
            assert time.monotonic() < deadline, "no L2 store succeeded after the master came back"
            attempt += 1
        _, _, text = fetch(server.http_url + "/metrics")
        assert metric(text, "lmcache_tiers_adapter_circuit_open", 'adapter="0:mooncake_store"') == 0.0
        with Client(server.url, timeout=30) as client:
            client.clear()
        hits, retrieved, equal, _ = run_in_process(job_lookup_retrieve, server.url, tag, 2, CHUNK, True)
        assert (hits, retrieved, equal) == (2, 2, True)
    finally:
        stop_cleanly(server)
