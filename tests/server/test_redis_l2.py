"""Real servers whose L2 is a real Redis: a restart of lmcache-tiers finds what it stored,
Redis killed mid-run degrades to misses (counted in /metrics) and heals without
restarting lmcache-tiers, and two servers share one Redis."""

from __future__ import annotations

import importlib.util
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tiers_e2e import (
    ServerProcess,
    fetch,
    job_lookup_retrieve,
    job_store,
    metric,
    run_in_process,
    start_server,
    stop_cleanly,
    wait_stored_in_l2,
)

from lmcache_tiers.client import Client

if importlib.util.find_spec("lmcache_plugin_redis") is None:
    pytest.skip("lmcache-plugin-redis is not installed", allow_module_level=True)

from lmcache_plugin_redis.testing import RedisServer, missing_reason

CHUNK = 256 << 10
WAIT_S = 60.0  # guards against hangs only
ADAPTER = "0:redis"


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def redis_adapter(server: RedisServer, prefix: str, **fields: Any) -> dict[str, Any]:
    return {
        "type": "redis",
        "url": server.url,
        "key_prefix": prefix,
        "request_timeout": 1.0,
        "connection_timeout": 1.0,
        "circuit": {"failure_threshold": 2, "probe_interval_s": 0.2},
        **fields,
    }


def wait_until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def metrics_of(server: ServerProcess) -> str:
    assert server.http_url is not None
    status, _, body = fetch(server.http_url + "/metrics")
    assert status == 200
    return body


def test_a_restarted_server_finds_what_it_stored_in_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    adapter = redis_adapter(redis_server, f"restart-{uuid.uuid4().hex[:8]}:")
    first = start_server(tmp_path / "first", adapters=[adapter])
    try:
        assert run_in_process(job_store, first.url, "persist", 6, CHUNK, True) == (6, True)
        wait_stored_in_l2(first, 6)
    finally:
        stop_cleanly(first)
    second = start_server(tmp_path / "second", adapters=[adapter])
    try:
        hits, retrieved, equal, _ = run_in_process(job_lookup_retrieve, second.url, "persist", 6, CHUNK, True)
        assert (hits, retrieved, equal) == (6, 6, True)
        with Client(second.url) as client:
            status = client.status()
        assert status["requests"]["l2_hit_chunks"] == 6
        assert status["adapters"][0]["used_bytes"] == 6 * CHUNK, "the start-up scan accounted the objects"
    finally:
        stop_cleanly(second)


def test_redis_killed_mid_run_degrades_to_misses_and_heals(tmp_path: Path, redis_server: RedisServer) -> None:
    server = start_server(tmp_path / "server", adapters=[redis_adapter(redis_server, "kill:")])
    try:
        assert run_in_process(job_store, server.url, "before", 4, CHUNK, True) == (4, True)
        wait_stored_in_l2(server, 4)
        with Client(server.url) as client:
            assert client.clear() == 4  # only Redis holds them now

        redis_server.stop()  # SIGKILL
        started = time.monotonic()
        for _ in range(3):
            hits, _, _, _ = run_in_process(job_lookup_retrieve, server.url, "before", 4, CHUNK, True)
            assert hits == 0
        assert time.monotonic() - started < WAIT_S, "lookups must not wait for the dead store"
        # L1 keeps serving: a chunk stored now is a hit from L1, its L2 store is skipped.
        assert run_in_process(job_store, server.url, "during", 2, CHUNK, True) == (2, True)
        assert run_in_process(job_lookup_retrieve, server.url, "during", 2, CHUNK, True)[:3] == (2, 2, True)
        wait_until(
            lambda: (
                metric(metrics_of(server), "lmcache_tiers_adapter_circuit_open", f'adapter="{ADAPTER}"') == 1
            ),
            "the circuit to open",
        )
        body = metrics_of(server)
        assert metric(body, "lmcache_tiers_adapter_backend_errors_total", f'adapter="{ADAPTER}"') >= 2
        assert metric(body, "lmcache_tiers_adapter_stat", f'adapter="{ADAPTER}",stat="circuit_opened"') == 1

        redis_server.start()  # the same port, empty (no persistence)
        wait_until(
            lambda: (
                metric(metrics_of(server), "lmcache_tiers_adapter_circuit_open", f'adapter="{ADAPTER}"') == 0
            ),
            "the circuit to close",
        )
        assert run_in_process(job_store, server.url, "after", 4, CHUNK, True) == (4, True)
        with Client(server.url) as client:
            wait_until(lambda: client.status()["adapters"][0]["keys_stored"] >= 8, "stores after the restart")
            client.clear()
        hits, retrieved, equal, _ = run_in_process(job_lookup_retrieve, server.url, "after", 4, CHUNK, True)
        assert (hits, retrieved, equal) == (4, 4, True), "hits from Redis resume without a restart"
        with Client(server.url) as client:
            backend = client.status()["adapters"][0]["backend"]
        assert backend["circuit_closed"] == 1
        assert backend["circuit_missed_lookup_keys"] >= 1
    finally:
        stop_cleanly(server)


def test_two_servers_share_one_redis(tmp_path: Path, redis_server: RedisServer) -> None:
    adapter = redis_adapter(redis_server, f"shared-{uuid.uuid4().hex[:8]}:")
    first = start_server(tmp_path / "first", adapters=[adapter])
    second = start_server(tmp_path / "second", adapters=[adapter])
    try:
        assert run_in_process(job_store, first.url, "shared", 5, CHUNK, True) == (5, True)
        wait_stored_in_l2(first, 5)
        hits, retrieved, equal, _ = run_in_process(job_lookup_retrieve, second.url, "shared", 5, CHUNK, True)
        assert (hits, retrieved, equal) == (5, 5, True)
        with Client(second.url) as client:
            assert client.status()["requests"]["l2_hit_chunks"] == 5
    finally:
        stop_cleanly(first)
        stop_cleanly(second)
