"""What one request may make the front end hold: read locks per key, keys, token arrays.

Each field is the client's choice; beyond a bound the request is refused or capped,
counted and logged, and answered where LMCache's server answers (a miss, no slots)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from lmcache_plugin_lmcache_mp.lookups import MAX_KV_READERS
from mpclient import Key, MPClient, Registration, chunk_payloads, tokens_of

from lmcache_tiers.server.app import TiersServer

REG = Registration()
CHUNK = REG.object_bytes


def mp_stats(server: TiersServer) -> Any:
    return server.frontends[0].stats()


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
