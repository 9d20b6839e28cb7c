"""The LMCache front end over a long uptime: rounds of connections that register, look up,
prepare stores and retrieves they never commit, end their sessions or not, unregister or
vanish -- once the TTLs have run out, the server process holds no more than after round 2:
file descriptors, threads, L1 segment mappings, resident memory and the front end's
tables (its instances, as /status lists them)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiers_e2e import ServerProcess, fetch, start_server
from uptime_churn import Holdings, wait_until_nothing_held

sys.path.insert(0, str(Path(__file__).parents[2] / "plugins" / "lmcache-mp" / "tests"))
from mpclient import Key, MPClient, Registration, chunk_payloads, tokens_of

ROUNDS = 5
CONNECTIONS_PER_ROUND = 30
TTL_S = 1.0
#: growth allowed between round 2 and the last (a scrape's socket, a pool thread between
#: two jobs): leaks grow by tens per round
SLACK = 3
#: resident memory allowed to grow between round 2 and the last: the allocator keeps
#: freed pages in its arenas; a leak of the rounds' tables or buffers grows by more
RSS_SLACK_BYTES = 16 << 20


@pytest.fixture
def mp_server(tmp_path: Path) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path / "server",
        adapters=[{"type": "mock", "max_size_gb": 0.5}],
        frontends=[
            {
                "type": "lmcache_mp",
                "session_ttl_s": TTL_S,
                "worker_reap_timeout_s": TTL_S,
                "worker_registration_grace_s": TTL_S,
            }
        ],
        l1_lock_ttl_s=TTL_S,
        l1_write_ttl_s=TTL_S,
    )
    yield proc
    assert proc.stop() == 0, proc.output()


def one_connection(url: str, tag: str, index: int) -> None:
    """Registers; every third one stores a prefix, looks it up (read locks) and leaves a
    retrieve uncommitted; the others miss and leave a store's reservation uncommitted.
    Half end their session, a quarter unregister, the rest just go away."""
    with MPClient(url, timeout_ms=30_000) as client:
        instance_id = 1 + index
        registration = Registration(instance_id=instance_id)
        shm = client.register(registration)["shm_name"]
        request_id = f"{tag}-{index}"
        key = Key(tokens_of(index), request_id, worker_id=0, cache_salt=tag)
        if index % 3 == 0:
            payloads = chunk_payloads(index, 4, registration.object_bytes)
            writer = Key(tokens_of(index), f"{request_id}-writer", worker_id=0, cache_salt=tag)
            assert client.store(writer, instance_id, payloads, shm)
            assert client.lookup(key) == 4
            assert client.call("prepare_retrieve", key.encode(), instance_id)["success"]
        else:
            client.lookup(key)
            client.call("prepare_store", key.encode(), instance_id)
        if index % 2 == 0:
            client.call("end_session", request_id)
        if index % 4 == 0:
            client.call("unregister_kv_cache_engine_driven_context", instance_id)


def registered_instances(server: ServerProcess) -> int:
    assert server.http_url is not None
    _, _, body = fetch(server.http_url + "/status")
    (frontend,) = [f for f in json.loads(body)["frontends"] if "instances" in f]
    return len(frontend["instances"])


def wait_until_reaped(server: ServerProcess, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while registered_instances(server):
        assert time.monotonic() < deadline, f"{registered_instances(server)} instances never reaped"
        time.sleep(0.2)


def resident_anonymous_bytes(pid: int) -> int:
    """Resident memory less the L1 segment's pages (shared memory the rounds' stores fill)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssAnon in /proc/{pid}/status")


def test_mp_connection_churn_gives_back_what_it_took(mp_server: ServerProcess) -> None:
    server = mp_server
    measured: dict[int, tuple[Holdings, int]] = {}
    for round_index in range(ROUNDS):
        for index in range(CONNECTIONS_PER_ROUND):
            one_connection(server.url, f"round{round_index}", index)
        wait_until_reaped(server)
        if round_index in (1, ROUNDS - 1):  # L1 reaps expired locks every 5 s: only where measured
            wait_until_nothing_held(server)
            measured[round_index] = (
                Holdings.of(server.proc.pid, server.shm_name),
                resident_anonymous_bytes(server.proc.pid),
            )
    (early, early_rss), (late, late_rss) = measured[1], measured[ROUNDS - 1]
    assert not late.grown_past(early, SLACK), late.grown_past(early, SLACK)
    assert late_rss <= early_rss + RSS_SLACK_BYTES, f"anonymous RSS {early_rss} -> {late_rss}"
