"""What one request may make the front end hold: read locks per key, keys, token arrays.

Each field is the client's choice; beyond a bound the request is refused or capped,
counted and logged, and answered where LMCache's server answers (a miss, no slots)."""

from __future__ import annotations

import logging
import os
import tracemalloc
from typing import Any

import pytest
from lmcache_plugin_lmcache_mp.chunks import HASH_BYTES, LOOKUP_KEY_BYTES, ChunkRange, keys_for_all_ranks
from lmcache_plugin_lmcache_mp.lookups import MAX_KV_READERS
from lmcache_plugin_lmcache_mp.state import LookupJob
from lmcache_plugin_lmcache_mp.wire import CacheKey
from mp_counts import mp_stats
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
MODEL_NAME = REG.model_name


def l1_read_locks(server: TiersServer) -> int:
    return int(server.storage.status()["l1"]["read_locks"])


def test_a_lookup_takes_at_most_max_kv_readers_locks_per_key(
    client: MPClient, mp_server: TiersServer, caplog: pytest.LogCaptureFixture
) -> None:
    shm = client.register(REG)["shm_name"]
    tokens = tokens_of(3)
    assert client.store(Key(tokens, "s", worker_id=0), REG.instance_id, chunk_payloads(3, 4, CHUNK), shm)
    with caplog.at_level(logging.WARNING):
        assert client.lookup(Key(tokens, "many", num_kv_readers=2**63 - 1)) == 4
    assert l1_read_locks(mp_server) == 4 * MAX_KV_READERS
    assert mp_stats(mp_server).failures["mp_kv_readers_capped"] == 1
    assert "mp_kv_readers_capped" in caplog.text
    # freeing gives them all back
    client.call("free_lookup_locks", Key(tokens, "many", num_kv_readers=2**63 - 1).encode(), 1)
    assert l1_read_locks(mp_server) == 0


def test_a_request_naming_more_than_max_request_keys_is_refused_where_lmcache_answers(
    make_mp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_mp_server(max_request_keys=3)
    with MPClient(mp_address(server)) as client, caplog.at_level(logging.WARNING):
        client.register(REG)
        key = Key(tokens_of(4), "big", worker_id=0)  # four chunks: four keys
        # a lookup is answered, with 0 hits, as a miss
        assert client.lookup(Key(tokens_of(4), "big")) == 0
        # a store gets no slots, so the client skips its copy and commit
        reply = client.call("prepare_store", key.encode(), REG.instance_id)
        assert reply == {"context": {"slots": [], "chunk_indices": []}}
        assert client.call("commit_store", key.encode(), REG.instance_id, b"") is False
        # a retrieve misses
        assert client.call("prepare_retrieve", key.encode(), REG.instance_id)["success"] is False
        assert client.call("commit_retrieve", key.encode(), REG.instance_id) is True
        # a range within the bound is served
        small = Key(tokens_of(4), "small", start=256, end=1024, worker_id=0)
        assert client.call("prepare_store", small.encode(), REG.instance_id)["context"]["chunk_indices"] == [
            0,
            1,
            2,
        ]
    stats = mp_stats(server)
    assert stats.failures["mp_request_too_large"] == 3  # lookup, prepare_store, prepare_retrieve
    assert stats.store_keys_refused["mp_request_too_large"] == 4  # the store's keys, once
    assert "max_request_keys (3)" in caplog.text
    assert server.frontends[0].shared.requests.peek("big") is not None  # its earlier state is kept
    assert server.frontends[0].shared.requests.peek("big").hashes.hashes == []  # nothing hashed


def test_a_lookup_counts_every_rank_against_max_request_keys(make_mp_server: Any) -> None:
    server = make_mp_server(max_request_keys=7)
    with MPClient(mp_address(server)) as client:
        client.register(Registration(world_size=2))
        assert client.lookup(Key(tokens_of(4), "r", world_size=2)) == 0  # 4 chunks x 2 ranks
    assert mp_stats(server).failures["mp_request_too_large"] == 1


def test_the_default_bounds_serve_a_128k_token_prompt_at_world_size_8(
    client: MPClient, mp_server: TiersServer
) -> None:
    client.register(Registration(world_size=8))
    tokens = tokens_of(5, 128 * 1024)
    assert client.lookup(Key(tokens, "long", world_size=8)) == 0  # nothing stored: a plain miss
    key = Key(tokens, "long", world_size=8, worker_id=3)
    reply = client.call("prepare_store", key.encode(), Registration().instance_id)
    assert len(reply["context"]["chunk_indices"]) == 512
    stats = mp_stats(mp_server)
    assert "mp_request_too_large" not in stats.failures
    assert "mp_request_dropped_memory" not in stats.failures


def remembered(server: TiersServer) -> int:
    return int(server.frontends[0].shared.requests.remembered_bytes)


def test_requests_beyond_max_remembered_mb_are_forgotten_least_recent_first(
    make_mp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_mp_server(max_remembered_mb=1)  # about 820 chunks of tokens and keys
    requests = server.frontends[0].shared.requests
    with MPClient(mp_address(server)) as client, caplog.at_level(logging.WARNING):
        client.register(REG)
        for index in range(3):  # 350 chunks each, about 375 KiB of tokens and hashes
            assert client.lookup(Key(tokens_of(index, 350 * 256), f"r{index}")) == 0
        wait_for(lambda: "mp_request_dropped_memory" in mp_stats(server).failures, "no request was forgotten")
        assert remembered(server) <= 1 << 20
        assert requests.peek("r0") is None and requests.peek("r2") is not None
    assert mp_stats(server).failures["mp_request_dropped_memory"] == 1
    assert "max_remembered_mb (1)" in caplog.text


def test_a_request_whose_tokens_alone_exceed_the_bound_is_refused(make_mp_server: Any) -> None:
    server = make_mp_server(max_remembered_mb=1)
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        assert client.lookup(Key(tokens_of(1, 1024 * 256), "huge")) == 0
    assert mp_stats(server).failures["mp_request_too_large"] == 1
    assert remembered(server) == 0


def test_a_request_remembers_its_tokens_hashes_and_lookup_keys_until_it_ends(
    client: MPClient, mp_server: TiersServer
) -> None:
    wide = Registration(world_size=8, num_layers=1, hidden_dim_size=8)
    shm = client.register(wide)["shm_name"]
    _store_every_rank(client, shm, wide, tokens_of(1))  # the lookup holds locks: it keeps its keys
    assert client.lookup(Key(tokens_of(1), "a", world_size=8)) == 4  # 4 chunks x 8 ranks
    assert remembered(mp_server) == 4 * (256 * 4 + HASH_BYTES) + 4 * 8 * LOOKUP_KEY_BYTES
    client.call("end_session", "a")
    assert remembered(mp_server) == 0


def _store_every_rank(client: MPClient, shm: str, registration: Registration, tokens: list[int]) -> None:
    """Store ``tokens`` for every rank; the storing requests end (they keep nothing)."""
    chunks = len(tokens) // 256
    for rank in range(registration.world_size):
        key = Key(tokens, f"store-{rank}", worker_id=rank, world_size=registration.world_size)
        payloads = chunk_payloads(rank, chunks, registration.object_bytes)
        assert client.store(key, registration.instance_id, payloads, shm)
        client.call("end_session", key.request_id)


def test_lookup_keys_count_against_max_remembered_mb(make_mp_server: Any) -> None:
    # 8 requests of 20 chunks at world size 64, each holding read locks on its hits: 170
    # KiB of tokens and hashes, but 1.7 MiB of lookup keys, over the bound
    server = make_mp_server(max_remembered_mb=1)
    wide = Registration(world_size=64, num_layers=1, hidden_dim_size=8)
    tokens = tokens_of(0, 20 * 256)
    with MPClient(mp_address(server)) as client:
        shm = client.register(wide)["shm_name"]
        _store_every_rank(client, shm, wide, tokens)
        for index in range(8):
            assert client.lookup(Key(tokens, f"r{index}", world_size=64)) == 20
        wait_for(lambda: remembered(server) <= 1 << 20, "the lookup keys were not counted")
    assert mp_stats(server).failures["mp_request_dropped_memory"] >= 1


@pytest.mark.parametrize(("world_size", "chunks"), [(1, 44_000), (8, 5_500), (255, 300)])
def test_a_lookup_key_with_its_read_lock_takes_no_more_than_its_estimate(
    world_size: int, chunks: int
) -> None:
    """max_remembered_mb counts LOOKUP_KEY_BYTES for each key a lookup keeps: the key, its
    slot in the lookup's list and, once the lookup hit it, its entry among the read locks
    the lookup holds.  An estimate below that lets the remembered requests take more than
    the bound says.  (Counts large enough that a lookup's fixed overhead does not matter.)"""
    key = CacheKey(MODEL_NAME, world_size, None, [], 0, 0, "r")
    hashes = [os.urandom(32) for _ in range(chunks)]  # the request's hashes: HASH_BYTES each
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        keys = keys_for_all_ranks(key, ChunkRange(0, chunks, hashes))
        job = LookupJob(0, keys, world_size, 1, 0.0)
        job.settle(len(keys))  # every key hit: the lookup holds a read lock on each
        taken = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    count = len(keys)
    assert len(job.held) == count == chunks * world_size
    assert taken <= count * LOOKUP_KEY_BYTES, f"{taken / count:.0f} bytes a key"


def test_a_request_forgotten_for_memory_gives_back_its_lookup_locks_and_says_why(
    make_mp_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_mp_server(max_remembered_mb=1)
    with MPClient(mp_address(server)) as client, caplog.at_level(logging.WARNING):
        shm = client.register(REG)["shm_name"]
        tokens = tokens_of(9)
        assert client.store(Key(tokens, "s", worker_id=0), REG.instance_id, chunk_payloads(9, 4, CHUNK), shm)
        assert client.lookup(Key(tokens, "held")) == 4
        assert l1_read_locks(server) == 4
        for index in range(3):  # about 375 KiB each: the oldest requests go, "held" first
            assert client.lookup(Key(tokens_of(index, 350 * 256), f"r{index}")) == 0
        wait_for(lambda: l1_read_locks(server) == 0, "the forgotten lookup kept its read locks")
        assert server.frontends[0].shared.requests.peek("held") is None
        # its client's next status query is a miss, as for any forgotten request
        assert client.call("query_prefetch_status", "held") == 0
    stats = mp_stats(server)
    assert stats.failures["mp_request_dropped_memory"] >= 2
    released = [r.getMessage() for r in caplog.records if "mp_lookup_locks_expired" in r.getMessage()]
    assert released and all("forgotten" in line for line in released)


def test_a_pickled_store_over_max_request_keys_is_counted_once(make_mp_server: Any) -> None:
    """With pickled chunks the prepare names no slots whatever the key (as in LMCache) and
    the commit that brings the chunks is refused: one store, one refusal, its keys once."""
    server = make_mp_server(shm=False, allow_pickle=True, max_request_keys=3)
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        key = Key(tokens_of(4), "big", worker_id=0)  # four chunks: four keys
        assert client.call("prepare_store", key.encode(), REG.instance_id) == {"context": {}}
        chunks = pickled_chunks(chunk_payloads(4, 4, CHUNK))
        assert client.call("commit_store", key.encode(), REG.instance_id, chunks) is False
    stats = mp_stats(server)
    assert (stats.failures["mp_request_too_large"], stats.store_keys_refused["mp_request_too_large"]) == (
        1,
        4,
    )


def test_the_stop_leaves_the_remembered_total_that_of_the_requests_kept(make_mp_server: Any) -> None:
    """The stop gives back every lookup's locks and forgets the lookups: their keys leave
    the total as on every other path, so the total stays the sum of what is kept."""
    server = make_mp_server()
    requests = server.frontends[0].shared.requests
    with MPClient(mp_address(server)) as client:
        shm = client.register(REG)["shm_name"]
        tokens = tokens_of(9)
        assert client.store(Key(tokens, "s", worker_id=0), REG.instance_id, chunk_payloads(9, 4, CHUNK), shm)
        assert client.lookup(Key(tokens, "held")) == 4
        server.request_stop()
        assert server.frontends[0].join(30)
    assert all(state.job is None for state in requests)
    assert remembered(server) == sum(state.nbytes() for state in requests) > 0


def test_max_remembered_mb_holds_between_sweeps(make_mp_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bound holds as each request is remembered, not only at the next sweep: between
    two sweeps, requests each within the bound would otherwise add up to any multiple of it
    (here the sweep never runs, so only the bound's own enforcement keeps the total)."""
    server = make_mp_server(max_remembered_mb=1)
    frontend = server.frontends[0]
    requests = frontend.shared.requests
    monkeypatch.setattr(frontend.handlers.lookups, "sweep", lambda now: None)
    with MPClient(mp_address(server)) as client:
        shm = client.register(REG)["shm_name"]
        tokens = tokens_of(9)
        assert client.store(Key(tokens, "s", worker_id=0), REG.instance_id, chunk_payloads(9, 4, CHUNK), shm)
        assert client.lookup(Key(tokens, "held")) == 4
        assert l1_read_locks(server) == 4
        for index in range(5):  # about 375 KiB each: five of them are 1.8 MiB
            assert client.lookup(Key(tokens_of(index, 350 * 256), f"r{index}")) == 0
            assert remembered(server) <= 1 << 20
            assert remembered(server) == sum(state.nbytes() for state in requests)
        assert requests.peek("held") is None and requests.peek("r4") is not None
        assert l1_read_locks(server) == 0  # the forgotten lookup gave its locks back
    assert mp_stats(server).failures["mp_request_dropped_memory"] >= 3
