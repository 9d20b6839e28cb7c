"""Connections that come and go -- registering, looking up, preparing stores and retrieves
they never commit, ending sessions or not, unregistering or vanishing -- leave nothing in
the front end's tables once the TTLs have passed, and no L1 reservation or read lock."""

from __future__ import annotations

import time
from typing import Any

from mpclient import Key, MPClient, Registration, chunk_payloads, mp_address, tokens_of

from lmcache_tiers.server.app import TiersServer

CONNECTIONS = 60
TTL_S = 1.0


def churn_one(url: str, index: int) -> None:
    with MPClient(url, timeout_ms=10_000) as client:
        instance_id = 1000 + index
        registration = Registration(instance_id=instance_id)
        shm = client.register(registration)["shm_name"]
        request_id = f"churn-{index}"
        key = Key(tokens_of(index), request_id, worker_id=0)
        if index % 3 == 0:  # stored whole, then looked up (read locks) and retrieved uncommitted
            payloads = chunk_payloads(index, 4, registration.object_bytes)
            assert client.store(
                Key(tokens_of(index), f"writer-{index}", worker_id=0), instance_id, payloads, shm
            )
            assert client.lookup(key) == 4
            assert client.call("prepare_retrieve", key.encode(), instance_id)["success"]
        else:  # looked up (a miss), then a store prepared and never committed
            client.lookup(key)
            assert client.call("prepare_store", key.encode(), instance_id)["context"]["slots"]
        if index % 2 == 0:
            client.call("end_session", request_id)
        if index % 4 == 0:
            client.call("unregister_kv_cache_engine_driven_context", instance_id)
        # otherwise the connection just goes away


def tables(server: TiersServer) -> dict[str, Any]:
    frontend = server.frontends[0]
    shared = frontend.shared
    handlers = frontend.handlers
    return {
        "instances": len(shared.instances),
        "requests": len(shared.requests),
        "pending stores": handlers.transfers.writes.count(),
        "pending retrieves": handlers.transfers.reads.count(),
        "lookup gauges": handlers.lookups.gauges(),
        "re-registration asks": len(handlers._asked_to_register),
        "L1 locks": (server.storage.l1.stats().write_locked, server.storage.l1.stats().read_locks),
        # what /metrics shows: refreshed at the end of the sweep that empties the tables, so
        # waited for with them, not read the instant the tables are empty
        "exported gauges": _exported_gauges(frontend.stats()),
    }


def _exported_gauges(stats: Any) -> tuple[int, int, int]:
    return (stats.locked_keys, stats.reserved_stores, stats.pending_prefetches)


def test_churned_connections_leave_the_tables_empty_after_the_ttls(make_mp_server: Any) -> None:
    server = make_mp_server(
        session_ttl_s=TTL_S,
        worker_reap_timeout_s=TTL_S,
        worker_registration_grace_s=TTL_S,
        l1_lock_ttl_s=TTL_S,
        # a reaped instance's stores are left to the write TTL (a silent client may be
        # stalled before its copy); longer than the lock TTL, so the stores that commit
        # are not lost on a loaded machine
        l1_write_ttl_s=5 * TTL_S,
    )
    url = mp_address(server)
    for index in range(CONNECTIONS):
        churn_one(url, index)
    empty = {
        "instances": 0,
        "requests": 0,
        "pending stores": 0,
        "pending retrieves": 0,
        "lookup gauges": (0, 0),
        "re-registration asks": 0,
        "L1 locks": (0, 0),
        "exported gauges": (0, 0, 0),
    }
    # L1 reaps expired locks every 5 s: a loaded machine may need a few of its rounds
    deadline = time.monotonic() + 60
    while tables(server) != empty and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tables(server) == empty
