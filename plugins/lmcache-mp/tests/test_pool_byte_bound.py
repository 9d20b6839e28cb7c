"""Pickled stores streamed faster than the pool copies them do not pile up their bytes on
the server: while the messages of the requests on the pool add up to
``frontend_pool_max_mb`` the front end reads no more, however far under its request bound
it is (the client's requests wait in ZeroMQ's queues), and every store is still answered
and stored once the pool has room."""

from __future__ import annotations

from typing import Any

import pytest
from mpclient import (
    MPClient,
    Registration,
    mp_address,
    send_pickled_store,
    stalled_fills,
    wait_for,
)

REG = Registration()
#: tokens per chunk (the server's default chunk_size)
CHUNK_TOKENS = 256
#: the byte bound (frontend_pool_max_mb) in MiB
BOUND_MB = 1
#: chunks per store: a store's message is a little over 256 KiB, so four of them reach the
#: bound and three do not
CHUNKS = 2
AT_BOUND = 4
STORES = 3 * AT_BOUND


def test_pickled_stores_past_the_byte_bound_wait_unread_then_are_all_stored(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert CHUNKS * REG.object_bytes == 256 << 10
    server = make_server(
        frontends=[
            # max_message_mb within the bound: a bound under it is refused at start-up
            {
                "type": "lmcache_mp",
                "shm": False,
                "allow_pickle": True,
                "workers": 1,
                "max_message_mb": BOUND_MB,
            }
        ],
        frontend_pool_max_mb=BOUND_MB,
    )
    storage, frontend = server.storage, server.frontends[0]
    router = frontend.loop.router
    assert router.max_pool_requests > STORES  # only the byte bound can hold the loop here
    with stalled_fills(storage, monkeypatch) as go_on, MPClient(mp_address(server)) as client:
        client.register(REG)
        uids = [
            send_pickled_store(client, 100 + sequence, f"bytes-{sequence}", CHUNKS, CHUNKS * CHUNK_TOKENS - 1)
            for sequence in range(STORES)
        ]
        wait_for(lambda: frontend.stats().pool_backpressure >= 1, "the loop holding its reading")
        assert frontend.stats().requests["commit_store"] == AT_BOUND  # the rest are not read
        assert router.in_pool == AT_BOUND
        assert router.pool_bytes >= BOUND_MB << 20
        assert frontend.stats().pool_backpressure_bytes == 1
        go_on.set()
        for uid in uids:
            assert client.no_reply_to(uid, wait_ms=30_000) is False
    stats = frontend.stats()
    assert stats.requests["commit_store"] == STORES
    assert stats.store_chunks == STORES * CHUNKS
    assert stats.pool_backpressure_bytes >= 1
