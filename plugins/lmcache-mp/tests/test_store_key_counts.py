"""Every key a store names is counted once: stored, skipped or refused, by why.

Keys a store names are those of its ``prepare_store`` (shared memory) or of its pickled
``commit_store``.  What L1 did not need (``store_keys_skipped``) and what was not stored
(``store_keys_refused``) count per key, so that keys named = ``store_chunks`` + skipped +
refused, whatever happened to the requests that named them.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest
from mp_counts import keys_accounted, mp_stats
from mpclient import (
    Key,
    MPClient,
    Registration,
    chunk_payloads,
    mp_address,
    pickled_chunks,
    tokens_of,
    wait_for,
)

from lmcache_tiers.server.app import TiersServer

REG = Registration()
CHUNK = REG.object_bytes


def test_keys_l1_had_or_another_writer_holds_are_skipped_per_key(
    client: MPClient, mp_server: TiersServer
) -> None:
    shm = client.register(REG)["shm_name"]
    tokens = tokens_of(2)
    assert client.store(
        Key(tokens, "half", end=512, worker_id=0), REG.instance_id, chunk_payloads(2, 2, CHUNK), shm
    )
    writer = Key(tokens, "writer", worker_id=0)
    assert client.call("prepare_store", writer.encode(), REG.instance_id)["context"]["chunk_indices"] == [
        2,
        3,
    ]
    # the first two are stored, the last two being written by "writer"
    other = client.call("prepare_store", Key(tokens, "other", worker_id=0).encode(), REG.instance_id)
    assert other == {"context": {"slots": [], "chunk_indices": []}}
    assert client.call("commit_store", writer.encode(), REG.instance_id, b"") is True
    stats = mp_stats(mp_server)
    assert stats.store_chunks == 4
    assert dict(stats.store_keys_skipped) == {"present": 4, "being_written": 2}
    assert keys_accounted(mp_server) == 2 + 4 + 4


def test_a_refused_store_counts_each_of_its_keys(make_mp_server: Any) -> None:
    server = make_mp_server(l1_size_gb=0.0007)  # room for five chunks
    with MPClient(mp_address(server)) as client:
        shm = client.register(REG)["shm_name"]
        assert client.store(
            Key(tokens_of(9), "s", worker_id=0), REG.instance_id, chunk_payloads(9, 4, CHUNK), shm
        )
        assert client.lookup(Key(tokens_of(9), "holding")) == 4  # locked: nothing can be evicted
        refused = client.call("prepare_store", Key(tokens_of(90), "r", worker_id=0).encode(), REG.instance_id)
        assert refused == {"context": {"slots": [], "chunk_indices": []}}
        stats = mp_stats(server)
        assert stats.failures["mp_store_refused_l1_full"] == 1  # the request
        assert stats.store_keys_refused["mp_store_refused_l1_full"] == 4  # its keys
        assert keys_accounted(server) == 4 + 4


def test_a_connection_that_did_not_register_has_its_keys_refused(
    client: MPClient, mp_server: TiersServer
) -> None:
    client.register(REG)
    with MPClient(mp_address(mp_server)) as stranger:
        key = Key(tokens_of(5), "r", worker_id=0)
        assert stranger.call("prepare_store", key.encode(), REG.instance_id)["context"]["slots"] == []
    assert mp_stats(mp_server).store_keys_refused["mp_transfer_unregistered_connection"] == 4


def test_a_repeated_prepare_counts_the_reservation_it_replaces(
    client: MPClient, mp_server: TiersServer
) -> None:
    shm = client.register(REG)["shm_name"]
    key = Key(tokens_of(30), "r", worker_id=0)
    client.call("prepare_store", key.encode(), REG.instance_id)
    assert client.store(key, REG.instance_id, chunk_payloads(30, 4, CHUNK), shm) is True  # prepares again
    stats = mp_stats(mp_server)
    assert (stats.store_chunks, dict(stats.store_keys_skipped)) == (4, {"repeated": 4})
    assert keys_accounted(mp_server) == 8


def test_a_reservation_never_committed_counts_its_keys(make_mp_server: Any) -> None:
    server = make_mp_server(l1_write_ttl_s=0.5)
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        client.call("prepare_store", Key(tokens_of(6), "walked-away", worker_id=0).encode(), REG.instance_id)
        stats = mp_stats(server)
        wait_for(lambda: stats.failures["mp_transfer_expired"] == 1, "the reservation never expired")
        assert stats.store_keys_refused["reservation_expired"] == 4
        assert keys_accounted(server) == 4


def test_a_commit_after_the_write_ttl_counts_the_keys_once(make_mp_server: Any) -> None:
    server = make_mp_server(l1_write_ttl_s=0.5)
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        key = Key(tokens_of(7), "late", worker_id=0)
        client.call("prepare_store", key.encode(), REG.instance_id)
        stats = mp_stats(server)
        wait_for(
            lambda: server.storage.status()["l1"]["write_locked"] == 0, "L1 never reaped the reservation"
        )
        assert client.call("commit_store", key.encode(), REG.instance_id, b"") is False
        wait_for(lambda: stats.failures["mp_transfer_expired"] == 1, "the expiry was never counted")
        assert stats.store_keys_refused["reservation_expired"] == 4
        assert keys_accounted(server) == 4


def test_unregistering_with_a_reservation_counts_its_keys(client: MPClient, mp_server: TiersServer) -> None:
    client.register(REG)
    client.call("prepare_store", Key(tokens_of(10), "r", worker_id=0).encode(), REG.instance_id)
    client.call("unregister_kv_cache_engine_driven_context", REG.instance_id)
    assert mp_stats(mp_server).store_keys_refused["unregistered"] == 4
    assert keys_accounted(mp_server) == 4


def test_a_reservation_held_at_shutdown_counts_its_keys(make_mp_server: Any) -> None:
    server = make_mp_server()
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        client.call("prepare_store", Key(tokens_of(15), "w", worker_id=0).encode(), REG.instance_id)
        server.request_stop()
        frontend = server.frontends[0]
        assert frontend.join(30)
        assert frontend.stats().store_keys_refused["shutting_down"] == 4
        assert keys_accounted(server) == 4


def test_refused_pickled_chunks_count_each_key(client: MPClient, mp_server: TiersServer) -> None:
    client.register(REG)
    key = Key(tokens_of(11), "r", worker_id=0)
    assert client.call("commit_store", key.encode(), REG.instance_id, b"not allowed") is False
    stats = mp_stats(mp_server)
    assert (stats.failures["mp_pickle_refused"], stats.store_keys_refused["mp_pickle_refused"]) == (1, 4)


def test_pickled_stores_count_each_key(make_mp_server: Any) -> None:
    server = make_mp_server(shm=False, allow_pickle=True, l1_size_gb=0.0007)  # room for five chunks
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        held = Key(tokens_of(9), "s", worker_id=0)
        assert client.call(
            "commit_store", held.encode(), REG.instance_id, pickled_chunks(chunk_payloads(9, 4, CHUNK))
        )
        again = Key(tokens_of(9), "again", worker_id=0)
        assert client.call(
            "commit_store", again.encode(), REG.instance_id, pickled_chunks(chunk_payloads(9, 4, CHUNK))
        )
        assert client.lookup(Key(tokens_of(9), "holding")) == 4  # locked: eviction cannot take them
        full = Key(tokens_of(90), "r", worker_id=0)
        assert (
            client.call(
                "commit_store", full.encode(), REG.instance_id, pickled_chunks(chunk_payloads(90, 4, CHUNK))
            )
            is False
        )
        assert client.call("commit_store", full.encode(), REG.instance_id, b"not a pickle") is False
        stats = mp_stats(server)
        assert stats.store_chunks == 4
        assert dict(stats.store_keys_skipped) == {"present": 4}
        assert stats.store_keys_refused["mp_store_refused_l1_full"] == 4
        assert stats.store_keys_refused["mp_pickle_rejected"] == 4
        assert keys_accounted(server) == 16


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_keys_of_random_stores_balance(make_mp_server: Any, seed: int) -> None:
    """Prepares (some repeated, some by a connection that did not register), commits in
    time, late or never, unregisters, and a full L1 in any order; after the stop, every
    key named is stored, skipped or refused exactly once."""
    rng = random.Random(seed)
    server = make_mp_server(l1_size_gb=0.0012, l1_write_ttl_s=0.4)  # room for about nine chunks
    named = 0
    with MPClient(mp_address(server)) as client, MPClient(mp_address(server)) as stranger:
        shm = client.register(REG)["shm_name"]
        for _ in range(60):
            chunks = rng.randint(1, 4)
            key = Key(tokens_of(rng.randint(0, 12), chunks * 256), rng.choice("abc"), worker_id=0)
            action = rng.random()
            if action < 0.45:
                named += chunks
                client.store(key, REG.instance_id, chunk_payloads(0, chunks, CHUNK), shm)
            elif action < 0.7:
                named += chunks
                client.call("prepare_store", key.encode(), REG.instance_id)  # committed later, or never
            elif action < 0.8:
                client.call("commit_store", key.encode(), REG.instance_id, b"")
            elif action < 0.87:
                named += chunks
                stranger.call("prepare_store", key.encode(), REG.instance_id)
            elif action < 0.93:
                client.call("unregister_kv_cache_engine_driven_context", REG.instance_id)
                client.register(REG)
            else:
                time.sleep(0.5)  # past the write TTL: reservations expire
        server.request_stop()
        frontend = server.frontends[0]
        assert frontend.join(30)
    stats = frontend.stats()
    assert named == keys_accounted(server), (
        named,
        stats.store_chunks,
        stats.store_keys_skipped,
        stats.store_keys_refused,
    )
